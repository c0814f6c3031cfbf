"""`fedbroker ledger`: a site's own account of what it spent and shared, from its privacy ledger, beside the
coordinator's record of it.

Run on the site, from the worker's config (`--config worker.yaml`, paths read from the current folder as
`fedbroker worker --config` reads them) or its kit (`--kit FOLDER`, paths read from the kit as its start.sh
does). It prints the total ε, the owner's budget and what is left, the ε of each job's training and of each
release (the label histogram, the standardisation statistics, ...), and the shared log: what left the site,
for which job, to whom, when, at what ε. A job with distributed DP shows two figures: its ε (distributed: the secure
sum carries the quorum's noise; the budget counts it) and its local-floor ε (this site's own noise share alone, were
every other site colluding with the server). `--json` prints the same as one document.

The ledger is only read: opened as an operator reads it (no worker id), which never writes it. A ledger below
its mark file is refused, as the worker refuses it.

The coordinator's view (`--remote`, and by default when the config names the coordinator and holds the site's
token): the SiteRecord call, with the site's own certificate and token, returns the ε the coordinator recorded
for the site and its jobs there. The two are compared: a ledger BELOW the coordinator's record is a lost or
replaced ledger (the worker refuses to train until it is restored; exit 1); a ledger above it is normal (ε the
coordinator has not heard of yet, a release drawn again, jobs of another coordinator).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import os
from typing import Any

import grpc

from fedbroker.app.status import DASH, table
from fedbroker.config import Config, load_config
from fedbroker.errors import ConfigError

KIT_CONFIG = "worker.yaml"   # a site kit's worker config (app/fedbroker/app/provision/kits.py)
REMOTE_TIMEOUT_S = 15.0


class Agreement(enum.StrEnum):
    """The ledger against the coordinator's record: in total, or for one job (the values `--json` prints)."""

    AGREE = "agree"
    LEDGER_BELOW = "ledger_below"            # the ledger holds less: lost or replaced (the worker refuses to train)
    LEDGER_ABOVE = "ledger_above"            # the ledger holds more: ε not yet heard of; normal
    LEDGER_ONLY = "ledger_only"              # a job only the ledger holds
    COORDINATOR_ONLY = "coordinator_only"    # a job only the coordinator holds
    NOT_ASKED = "not_asked"                  # in total: the coordinator was not asked
    NO_RECORD = "no_record"                  # in total: the coordinator gave no record of this site


@dataclasses.dataclass(frozen=True)
class SiteConfig:
    """The worker's config with its file paths made absolute, and whether it names the coordinator to ask."""

    config: Config
    names_coordinator: bool    # coordinator.target set in the file or the environment, and a token to send


def site_config(args: argparse.Namespace) -> SiteConfig:
    """From `--kit FOLDER` (its worker.yaml) or `--config FILE`: the file's relative paths from its own folder
    (fedbroker.config), those of FEDBROKER__ variables (which override either, as they do for the worker) from the
    kit or from here."""
    if bool(args.kit) == bool(args.config):
        raise ConfigError("--config/--kit", "give the site's worker config (--config worker.yaml) or its kit folder "
                                            "(--kit FOLDER), one of them")
    path = os.path.join(args.kit, KIT_CONFIG) if args.kit else args.config
    if not os.path.isfile(path):
        raise ConfigError("--kit" if args.kit else "--config", f"no worker config at {path}")
    base = os.path.abspath(args.kit or os.getcwd())
    config = _rebased(load_config(path), base)
    named = _names_coordinator(path) and bool(config.client.token or config.client.token_file)
    return SiteConfig(config, named)


def _rebased(config: Config, base: str) -> Config:
    """The config's file paths, absolute from `base`."""
    def at(p: str) -> str:
        return os.path.join(base, p) if p else p

    c = config.client
    client = dataclasses.replace(c, token_file=at(c.token_file), ca_file=at(c.ca_file), cert_file=at(c.cert_file),
                                 key_file=at(c.key_file))
    worker = dataclasses.replace(config.worker, ledger_path=at(config.worker.ledger_path))
    return dataclasses.replace(config, client=client, worker=worker)


def _names_coordinator(path: str) -> bool:
    """Whether the file (or a FEDBROKER__COORDINATOR__TARGET variable) sets coordinator.target: the default
    target is no coordinator this site was told about."""
    from fedbroker.config import MAX_CONFIG_BYTES
    from fedbroker.job.yamltext import load_yaml

    if os.environ.get("FEDBROKER__COORDINATOR__TARGET"):
        return True
    with open(path, "rb") as fh:
        raw = load_yaml(fh.read(MAX_CONFIG_BYTES + 1), where=path, max_bytes=MAX_CONFIG_BYTES) or {}
    section = raw.get("coordinator") if isinstance(raw, dict) else None
    return isinstance(section, dict) and bool(section.get("target"))


def local_view(config: Config) -> dict[str, Any]:
    """What the site's ledger holds, read without writing it: totals, budget, jobs, releases and the shared log."""
    from fedbroker.worker.ledger import PrivacyLedger, fresh_ledgers

    path = config.worker.ledger_path
    note = ""
    if os.path.isdir(path):
        raise ConfigError("worker.ledger_path", f"{path} is a folder, not a privacy ledger")
    if not os.path.exists(path):  # read as empty, never created; refused if its mark says ε was spent
        note = (f"no ledger file at {path} yet: nothing spent or released so far (or this is not the path its "
                f"worker uses)")
        with fresh_ledgers():  # not "starting a new one": nothing is started here
            ledger = PrivacyLedger(path)
    else:
        ledger = PrivacyLedger(path)  # no worker id: an operator's read, which writes nothing
    if ledger.worker_id is not None and ledger.worker_id != config.worker.id:
        raise ConfigError("worker.id", f"{path} is the ledger of worker {ledger.worker_id!r}, but the config names "
                                       f"{config.worker.id!r}")
    jobs, spent, floors = ledger.jobs(), ledger.releases(), ledger.floors()
    releases = []
    for name, epsilon in spent.items():
        kept = ledger.release(name)
        releases.append({"name": name, "epsilon": epsilon, "draw_epsilon": kept.draw_epsilon if kept else 0.0,
                         "value": kept.value if kept else []})
    total = ledger.total_epsilon()
    dp = config.worker.dp
    return {
        "worker_id": config.worker.id, "ledger_path": os.path.abspath(path),
        "epsilon_total": total, "epsilon_training": sum(jobs.values()), "epsilon_releases": sum(spent.values()),
        "dp": {"enabled": dp.enabled, "epsilon_budget": dp.epsilon_budget if dp.enabled else None,
               "delta": dp.delta if dp.enabled else None,
               "epsilon_left": dp.epsilon_budget - total if dp.enabled else None},
        "jobs": [{"job_id": job_id, "epsilon": epsilon} | ({"local_floor_epsilon": floors[job_id]} if job_id in floors
                                                           else {}) for job_id, epsilon in jobs.items()],
        "releases": releases,
        "shared": [{**dataclasses.asdict(s), "time": _when(s.time_unix)} for s in ledger.shared()],
        "note": note,
    }


def remote_view(site: SiteConfig, target: str) -> dict[str, Any]:
    """The coordinator's record of this site (SiteRecord, with the site's own token and certificate); an
    unreachable coordinator, a refusal or an unknown site is kept as `error`: the local ledger is shown all the same."""
    from fedbroker.app.jobs import as_dict
    from fedbroker.app.launch import client_security
    from fedbroker.coordinator.service import CoordinatorClient

    client = CoordinatorClient(target, security=client_security(site.config), timeout_s=REMOTE_TIMEOUT_S)
    try:
        reply = client.site_record(site.config.worker.id)
    except grpc.RpcError as error:
        return {"target": target, "error": f"{error.code().name}: {error.details()}"}
    finally:
        client.close()
    return {"target": target, "error": "", "epsilon_recorded": reply.epsilon_recorded,
            "worker": as_dict(reply.worker), "jobs": [as_dict(j) for j in reply.jobs]}


def compare(local: dict[str, Any], remote: dict[str, Any] | None) -> dict[str, Any]:
    """The ledger against the coordinator's record, in total and per job (`status` of each: an
    `Agreement`, LEDGER_ONLY or COORDINATOR_ONLY for a job one side does not hold)."""
    from fedbroker.worker.ledger import below

    if remote is None or remote["error"]:
        return {"status": Agreement.NOT_ASKED if remote is None else Agreement.NO_RECORD, "jobs": [],
                "message": "the coordinator was not asked (--remote asks it)" if remote is None
                else f"the coordinator at {remote['target']} gave no record of this site: {remote['error']}"}
    ours = {j["job_id"]: j["epsilon"] for j in local["jobs"]}
    theirs = {j["job_id"]: j["epsilon"] for j in remote["jobs"]}
    rows = []
    for job_id in [*ours, *(j for j in theirs if j not in ours)]:
        a, b = ours.get(job_id), theirs.get(job_id)
        state = (Agreement.COORDINATOR_ONLY if a is None else Agreement.LEDGER_ONLY if b is None
                 else Agreement.LEDGER_BELOW if below(a, b) else Agreement.LEDGER_ABOVE if below(b, a)
                 else Agreement.AGREE)
        if state is Agreement.COORDINATOR_ONLY and not b:
            state = Agreement.AGREE  # a job it was asked for but never trained in: nothing to hold
        rows.append({"job_id": job_id, "ledger_epsilon": a, "coordinator_epsilon": b, "status": state})
    # the coordinator records the training it priced, never the site's releases (its heartbeats are advisory)
    total, recorded = local.get("epsilon_training", local["epsilon_total"]), remote["epsilon_recorded"]
    short = [r["job_id"] for r in rows if r["status"] in (Agreement.LEDGER_BELOW, Agreement.COORDINATOR_ONLY)]
    if below(total, recorded) or short:
        status = Agreement.LEDGER_BELOW
        message = (f"the ledger holds less than the coordinator recorded (ε {total:.6g} < {recorded:.6g}"
                   + (f"; short for job(s) {', '.join(short)}" if short else "") + "): a lost or replaced ledger. "
                   "The worker refuses to train until the latest ledger is restored (deploy/OPERATING.md)")
    elif below(recorded, total):
        status = Agreement.LEDGER_ABOVE
        message = (f"the ledger holds more than the coordinator recorded (ε {total:.6g} > {recorded:.6g}): ε it has "
                   f"not heard of yet (a heartbeat away), a release drawn again, or jobs of another coordinator; normal")
    else:
        status, message = Agreement.AGREE, f"the ledger and the coordinator's record agree (ε {total:.6g})"
    return {"status": status, "jobs": rows, "message": message}


def site_view(args: argparse.Namespace) -> dict[str, Any]:
    """The whole document `--json` prints: the ledger, the coordinator's record (or null) and their agreement."""
    site = site_config(args)
    view = local_view(site.config)
    ask = (site.names_coordinator or bool(args.coordinator)) if args.remote is None else args.remote
    target = args.coordinator or site.config.coordinator.target
    remote = remote_view(site, target) if ask else None
    view["coordinator"] = remote
    view["agreement"] = compare(view, remote)
    return view


def _when(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if unix else ""


def _eps(value: float | None) -> str:
    return DASH if value is None else f"{value:.4g}"


def render(view: dict[str, Any]) -> str:
    """The text form: totals and budget, then per job, per release, the shared log, and the comparison."""
    dp = view["dp"]
    lines = [f"site {view['worker_id']}: privacy ledger {view['ledger_path']}"
             + (f" ({view['note']})" if view["note"] else ""),
             f"ε spent    {view['epsilon_total']:.4g} (training {view['epsilon_training']:.4g}, releases "
             f"{view['epsilon_releases']:.4g}; basic composition: the plain sum)",
             f"budget     {dp['epsilon_budget']:g} at δ {dp['delta']:g}: ε {dp['epsilon_left']:.4g} left"
             if dp["enabled"] else "budget     none: DP is off in this config (training spends no ε)"]
    coordinator = {r["job_id"]: r for r in (view["coordinator"] or {}).get("jobs", [])}
    checks = {r["job_id"]: r["status"] for r in view["agreement"]["jobs"]}
    job_ids = [j["job_id"] for j in view["jobs"]] + [j for j in coordinator if j not in
                                                     {k["job_id"] for k in view["jobs"]}]
    ours = {j["job_id"]: j["epsilon"] for j in view["jobs"]}
    floors = {j["job_id"]: j["local_floor_epsilon"] for j in view["jobs"] if "local_floor_epsilon" in j}
    lines += ["", "TRAINING (ε per job; distributed DP: the floor is this site's own noise share alone)", table(
        ["job", "ε (ledger)", "ε local floor", "ε (coordinator)", "rounds", "job status", "check"],
        [[j, _eps(ours.get(j)), _eps(floors.get(j)), _eps(coordinator[j]["epsilon"]) if j in coordinator else DASH,
          coordinator[j]["rounds"] if j in coordinator else DASH,
          coordinator[j]["status"] if j in coordinator else DASH, checks.get(j, DASH)] for j in job_ids])]
    lines += ["", "RELEASES (ε per release: drawn once, re-sent at no new cost)", table(
        ["release", "ε spent", "ε of the kept draw", "published value"],
        [[r["name"], _eps(r["epsilon"]), _eps(r["draw_epsilon"]), _value(r["value"])] for r in view["releases"]])]
    lines += ["", "SHARED (what left this site, oldest first)", table(
        ["time (UTC)", "job", "what", "to", "ε"],
        [[s["time"], s["job_id"], s["what"], s["recipient"], _eps(s["epsilon"])] for s in view["shared"]])]
    remote = view["coordinator"]
    lines.append("")
    if remote is not None and not remote["error"]:
        lines.append(f"COORDINATOR {remote['target']}: recorded ε {remote['epsilon_recorded']:.4g}; "
                     + ("shared per job: " + "; ".join(f"{j}: {', '.join(r['shared'])}" for j, r in coordinator.items()
                                                       if r["shared"]) if any(r["shared"] for r in coordinator.values())
                        else "no shares recorded"))
    flag = "WARNING: " if view["agreement"]["status"] in (Agreement.LEDGER_BELOW, Agreement.NO_RECORD) else ""
    lines.append(flag + view["agreement"]["message"])
    return "\n".join(lines)


def _value(value: list[Any]) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else f"{len(value)} values"


def cmd_ledger(args: argparse.Namespace) -> int:
    """Print the site's ledger (and the coordinator's record); exit 1 when the ledger is below that record, or
    when --remote asked a coordinator that gave no record (unreachable, refused, or it does not know the site)."""
    view = site_view(args)
    print(json.dumps(view, indent=2) if args.json else render(view))
    status = view["agreement"]["status"]
    return 1 if status == Agreement.LEDGER_BELOW or (status == Agreement.NO_RECORD and args.remote) else 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker ledger` under the main parser's subcommands."""
    p = sub.add_parser("ledger", help="a site's ε spent, budget left, per job and release, and what it shared "
                                      "(beside the coordinator's record of it)")
    p.add_argument("--config", help="the site's worker config (the file `fedbroker worker --config` takes)")
    p.add_argument("--kit", help="the site's kit folder (its worker.yaml; paths from the kit)")
    p.add_argument("--remote", action=argparse.BooleanOptionalAction, default=None,
                   help="ask the coordinator for this site's record (default: when the config names the coordinator "
                        "and holds the site's token)")
    p.add_argument("--coordinator", help="host:port of the coordinator (default: coordinator.target)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=cmd_ledger)
