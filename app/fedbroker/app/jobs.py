"""`fedbroker jobs list | show | cancel | logs | download`: a data scientist's view of a job's whole life.

Every read verb prints a table by default and JSON with `--json` (one document; `logs` prints one JSON
object per event, so `--follow` can be piped). An unknown job id exits 1 with the coordinator's message.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import safetensors.numpy

from fedbroker.app import evaluation_view
from fedbroker.app.evaluation_view import best, site_table
from fedbroker.app.model_readme import data_section, input_section, output_section
from fedbroker.app.replies import job_status, participant_status, read
from fedbroker.app.round_notes import event_words
from fedbroker.app.status import one_line, render, round_progress, table
from fedbroker.errors import ConfigError
from fedbroker.files import write_atomic
from fedbroker.job.alignment_plan import alignment_plan
from fedbroker.job.model_spec import Collector, model_bounds, parse_model
from fedbroker.job.status import FINISHED, REFUSED_OR_FAILED, SENT, JobStatus, ParticipantStatus
from fedbroker.layers import LAYERS
from fedbroker.printable import printable
from fedbroker.secagg.secure_round import describe as describe_secure
from fedbroker.secagg.secure_round import round_params
from fedbroker.weights.plan import ModelPlan, merge_adapters, parse_plan

if TYPE_CHECKING:
    from fedbroker.coordinator.service import CoordinatorClient

MODEL_FILE = "model.safetensors"
SPEC_FILE = "model_spec.json"
JOB_FILE = "job.json"
README_FILE = "README.md"
MAX_ROUND = 2**31 - 1  # the wire's round is an int32

# What `jobs download` writes next to the weights; tests run it as it is written.
LOAD_SNIPPET = '''\
import json

from safetensors.torch import load_file

from fedbroker.model import build_model
from fedbroker.job.spec import parse_model

with open("{spec}", encoding="utf-8") as fh:
    spec = parse_model(json.load(fh))
model = build_model(spec)
model.load_state_dict(load_file("{model}"))
model.eval()
'''


def client(args: argparse.Namespace) -> CoordinatorClient:
    """A coordinator client from `--config` (or FEDBROKER__* variables): the targets (`--coordinator a,b`, else
    coordinator.targets, else coordinator.target; a standby is passed over: failover.py), this user's token and
    TLS from the `client` section."""
    from fedbroker.app.failover import coordinator_client, targets_of
    from fedbroker.app.launch import client_security
    from fedbroker.config import load_config

    config = load_config(getattr(args, "config", None))
    c = config.coordinator
    targets = targets_of(getattr(args, "coordinator", None), c.targets, c.target)
    return coordinator_client(targets, security=client_security(config))


def as_dict(message: Any) -> dict[str, Any]:
    """Every `--json` output's one shape: keys in the message's field order, numbers as numbers (protobuf's own
    JSON writes int64 as strings), and a job's `spec_json` as a `spec` object."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.name == "spec_json":
            out["spec"] = json.loads(value) if value else None
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)   # a map (a round's federated scores by name)
        elif field.is_repeated:
            out[field.name] = [as_dict(v) if field.message_type else v for v in value]
        else:
            out[field.name] = as_dict(value) if field.message_type else value
    return out


def _when(unix: float) -> str:
    return datetime.datetime.fromtimestamp(unix, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S") if unix else ""


def cmd_list(args: argparse.Namespace) -> int:
    """`jobs list`: every job the coordinator holds, one row each."""
    with client(args) as c:
        reply = c.status("")
    jobs = list(reply.jobs)
    if args.json:
        print(json.dumps([as_dict(j) for j in jobs], indent=2))
    else:
        print(table(["job", "name", "status", "rounds", "submitter", "submitted (UTC)", "waiting", "error"],
                    [[j.job_id, j.name, j.status, round_progress(j, reply.rounds), j.submitter or "-",
                      _when(j.created_unix), j.waiting or "-", one_line(j.error)] for j in jobs]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """`jobs show ID`: the job's settings, its rounds and the workers it asked."""
    with client(args) as c:
        status = c.status(args.job_id)
        events = list(c.events(args.job_id))
    shared = [e for e in events if e.kind in SHARE_EVENTS]
    site_dp = [e.message for e in events if e.kind == "site_dp"][-1:]  # privacy.site: the ε of every round so far
    ddp = [e for e in events if e.kind == "ddp"]  # each distributed-DP round's record (fedbroker.secagg.ddp_record)
    (job,) = status.jobs
    spec = json.loads(job.spec_json or "{}")
    secure_n = secure_round_size(spec, status.rounds)
    if args.json:
        doc = show_document(status, shared)
        if secure_n:  # what a secure round of this job runs with: ring bits, clip range, threshold
            doc["secure"] = {"participants": secure_n, **round_params(secure_n).describe()}
            distributed = (spec.get("privacy") or {}).get("distributed")
            if distributed:  # the ring is each round's own (its record, `ddp`), not the weighted updates' above
                doc["secure"]["distributed"] = distributed
        if ddp:
            doc["ddp"] = [{"round": e.round, **json.loads(e.message)} for e in ddp]
        if site_dp:
            doc["site_dp"] = site_dp[0]
        print(json.dumps(doc, indent=2))
        return 0
    facts = [("job", job.job_id), ("name", job.name), ("status", job.status), ("category", job.category),
             ("mode", job.mode or "sync"), ("rounds", round_progress(job, status.rounds)),
             ("submitter", job.submitter or "-"), ("submitted", _when(job.created_unix) + " UTC"),
             ("updated", _when(job.updated_unix) + " UTC"), *settings(spec), *layerwise_rounds(spec)]
    if secure_n:
        facts.append(("secure", describe_secure(secure_n, distributed=(spec.get("privacy") or {}).get("distributed"))))
    facts += [("site-level DP", message) for message in site_dp]
    facts += [(f"round {e.round}", event_words(e.kind, e.round, e.message)) for e in ddp]
    facts += [("standardised" if e.kind == "statistics_agreed" else "sharing",
               f"{e.worker_id + ': ' if e.worker_id else ''}{e.message}") for e in shared]
    if job.error:
        facts.append(("error", job.error))
    if job.waiting:
        facts.append(("waiting", job.waiting))
    width = max(len(k) for k, _ in facts)
    print("\n".join(f"{k.ljust(width)}  {printable(str(v))}" for k, v in facts))
    print()
    print(render(status, workers=False, waiting=False))
    noted = [p for p in status.participants if participant_status(p) in SENT and p.reason]
    if noted:  # a robust rule's verdicts (`aggregation.robust`): who it discarded or down-weighted, per round
        print()
        print("UPLOADS WITH A NOTE (e.g. discarded or down-weighted by the robust rule)")
        print(table(["round", "worker", "status", "note"], [[p.round, p.worker_id, p.status, p.reason] for p in noted]))
    if status.evaluations:
        print()
        print("EVALUATIONS (each site's score on its own held-out split)")
        print(site_table(status))
    federated = evaluation_view.score_table(status, job.job_id)
    if federated:
        print()
        print("FEDERATED SCORES (from the sites' summed sums; per class or finding)")
        print(federated)
    print()
    print("WORKERS (this job)")
    print(job_workers(status))
    return 0


def show_document(status: Any, events: Iterable[Any]) -> dict[str, Any]:
    """`jobs show --json`'s one document: the job's row, its rounds, participants, what its sites shared before
    round 1 (of `events`, the sharing ones) and its sites' evaluations. Tracking logs from the same document."""
    (job,) = status.jobs
    doc = as_dict(job)
    doc["rounds"] = [as_dict(r) for r in status.rounds]
    doc["participants"] = [as_dict(p) for p in status.participants]
    doc["sharing"] = [as_dict(e) for e in events if e.kind in SHARE_EVENTS]
    doc["evaluations"] = [as_dict(e) for e in status.evaluations]
    return doc


def settings(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """The job's settings, one line each: what it trains and how, as submitted."""
    model = spec.get("model") or {}
    out = model_facts(model) if model else []
    swaps = substitutions(model)
    if swaps:
        out.append(("trains as", "; ".join(swaps)))
    for section in ("training", "schedule", "aggregation", "evaluation", "data"):
        values = spec.get(section)
        if values:
            out.append((section, ", ".join(f"{k} {json.dumps(v) if isinstance(v, (dict, list, bool)) else v}"
                                           for k, v in values.items() if v != {} and _UNSET.get(k) != v)))
    return out


def layerwise_rounds(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """For a job in the layer-wise mode, a line saying what each of its rounds matches: the model sets the
    number of rounds (one per matched layer), and each round freezes the layers matched before it."""
    aggregation = spec.get("aggregation") or {}
    if (aggregation.get("alignment_params") or {}).get("mode") != "layerwise":
        return []
    try:
        plan = alignment_plan(parse_model(spec.get("model")))
    except (ConfigError, TypeError, ValueError):
        return []
    steps = [f"round {r} matches {m.node}" for r, m in enumerate(plan.layers[:-1], start=1)]
    steps.append(f"round {len(plan.layers)} averages {plan.layers[-1].node} by class shares")
    return [("layer-wise", f"{plan.layerwise_rounds} rounds set by the model, one per matched layer: "
                           f"{'; '.join(steps)}; each round freezes the layers matched before it")]


_UNSET = {"secure": False, "robust": "none", "max_update_value": 0.0, "secure_group_size": 0}  # left out of the line at their defaults (secure: a line of its own)


def secure_round_size(spec: dict[str, Any], rounds: Any) -> int:
    """For a secure job, the participants its secure settings are shown for: its last round's, else what its
    schedule asks for (clients_per_round, else min_workers); 0 for a job that is not secure."""
    if not (spec.get("aggregation") or {}).get("secure"):
        return 0
    schedule = spec.get("schedule") or {}
    last = max((int(r.participants) for r in rounds), default=0)
    return max(2, last or int(schedule.get("clients_per_round") or 0) or int(schedule.get("min_workers") or 1))


def substitutions(model: dict[str, Any]) -> list[str]:
    """'<where> <what the job wrote> trains as <what trains>' for each layer spelt as one type that trains as
    another (BatchNorm as GroupNorm under DP: `fedbroker.layers`), in the chain form and in a graph's nodes."""
    places = [(f"layers[{i}]", layer) for i, layer in enumerate(model.get("layers") or [])]
    nodes = model.get("nodes")
    places += [(f"nodes.{name}", node) for name, node in nodes.items()] if isinstance(nodes, dict) else []
    out = []
    for where, layer in places:
        kind = layer.get("type") if isinstance(layer, dict) else None
        entry = LAYERS.get(kind) if isinstance(kind, str) else None
        if entry is not None and entry.substitution is not None:
            try:
                out.append(f"{where} {entry.substitution(layer)}")
            except (KeyError, TypeError, ValueError):  # a spec the parser refused: the view shows what it can
                continue
    return out


def model_facts(model: dict[str, Any]) -> list[tuple[str, str]]:
    """The model's line (a chain's layers; a graph's size, blocks and output) and its bounds: parameters,
    activation memory and FLOPs per sample, what a site's worker.limits are compared with."""
    if "nodes" in model:
        blocks = ", ".join(model.get("blocks") or {}) or "none"
        line = f"input {model.get('input_shape')}: graph of {len(model['nodes'])} nodes (blocks: {blocks}), " \
               f"output {model.get('output')}"
    else:
        line = f"input {model.get('input_shape')}: " + " → ".join(_layer(layer) for layer in model.get("layers", []))
    out = [("model", line)]
    try:
        spec = parse_model(model)
        bounds = model_bounds(spec)
    except ConfigError:  # a job the coordinator accepted parses; an older text may not: its line stays
        return out
    if spec.is_graph:
        out[0] = ("model", f"{line} ({len(spec.nodes)} nodes expanded)")
    return [*out, ("bounds", bounds.describe())]


def _layer(layer: dict[str, Any]) -> str:
    args = [f"{k}={v}" for k, v in layer.items() if k != "type"]
    return f"{layer.get('type')}({', '.join(args)})" if args else str(layer.get("type"))


def job_workers(status: Any) -> str:
    """One row per worker the job asked: rounds it was aggregated in, refusals and failures, ε the job spent on
    its data (the largest it reported), its samples."""
    rows: dict[str, list[Any]] = {}
    for p in status.participants:
        row = rows.setdefault(p.worker_id, [p.worker_id, 0, 0, 0.0, 0])
        said = participant_status(p)
        row[1] += said is ParticipantStatus.AGGREGATED
        row[2] += said in REFUSED_OR_FAILED
        row[3] = max(row[3], p.epsilon)
        row[4] = max(row[4], p.num_samples)
    return table(["worker", "aggregated in", "refused/failed", "ε spent", "samples"],
                 [[w, a, r, f"{e:.3f}" if e else "-", n or "-"] for w, a, r, e, n in rows.values()])


def cmd_cancel(args: argparse.Namespace) -> int:
    """`jobs cancel ID`: ask the coordinator to stop a job you submitted; it answers whether it has stopped yet."""
    with client(args) as c:
        status = c.cancel(args.job_id)
    if args.json:
        print(json.dumps({"job_id": args.job_id, "status": status}))
    elif read(JobStatus, status) is JobStatus.CANCELLED:
        print(f"job {args.job_id} cancelled")
    else:
        print(f"job {args.job_id}: {status} (`fedbroker jobs logs {args.job_id} --follow` shows when it stops)")
    return 0


def follow_events(c: Any, job_id: str, *, follow: bool) -> Iterator[Any]:
    """The job's events; when following, across the server's stream limit, until the job has ended."""
    after = 0
    while True:
        for event in c.events(job_id, after=after, follow=follow):
            after = event.seq
            yield event
        if not follow:
            return
        (job,) = c.status(job_id).jobs
        if job_status(job) in FINISHED:
            for event in c.events(job_id, after=after):  # anything written with its final status
                after = event.seq
                yield event
            return


# What sites shared with the job before round 1 (coordinator/sharing.py), as `jobs show` lists it.
SHARE_EVENTS = ("share_requested", "shared", "share_refused", "statistics_excluded", "not_shared", "histograms_shared",
                "statistics_agreed")
ASYNC_KINDS = {"round_opened": "buffer_filled", "round_closed": "version_published"}  # an async job has versions, not rounds


def print_events(c: Any, job_id: str, *, as_json: bool, follow: bool) -> None:
    """The job's events, one line (or JSON object) each; with `follow`, until the job has ended."""
    show = event_printer(c, job_id, as_json=as_json)
    for e in follow_events(c, job_id, follow=follow):
        show(e)


def event_printer(c: Any, job_id: str, *, as_json: bool) -> Callable[[Any], None]:
    """Prints one event as `jobs logs` does: a line (an async job's rounds named as its versions) or JSON."""
    (job,) = c.status(job_id).jobs
    mode = job.mode or "sync"
    versions: dict[int, int] = {}

    def show(e: Any) -> None:
        if as_json:
            print(json.dumps({**as_dict(e), "mode": mode}), flush=True)
            return
        kind, where, words = e.kind, f"round {e.round}" if e.round else "", event_words(e.kind, e.round, e.message)
        if mode == "async" and e.round:
            if e.round not in versions:  # the version a buffer made: from the job's rows, fetched as needed
                versions.update({r.round: r.model_version for r in c.status(job_id).rounds})
            kind = ASYNC_KINDS.get(kind, kind)
            where = f"version {versions[e.round]}" if versions.get(e.round) else ""
        print(f"{_when(e.time_unix)}  {kind:<16} {where:<11} {e.worker_id:<16} {words}".rstrip(), flush=True)

    return show


def cmd_logs(args: argparse.Namespace) -> int:
    """`jobs logs ID [--follow]`: the job's events, one line (or JSON object) each."""
    with client(args) as c:
        try:
            print_events(c, args.job_id, as_json=args.json, follow=args.follow)
        except KeyboardInterrupt:
            return 130
    return 0


def write_model(out: Path, header: Any, tensors: dict[str, np.ndarray], job_spec_json: str) -> dict[str, str]:
    """The model as safetensors, its spec, the job and a README whose snippet loads it; the paths written.
    A job with LoRA adapters is written as the plain model it computes: each target's W + (alpha/rank)·B·A."""
    out.mkdir(parents=True, exist_ok=True)
    adapters = _job_plan(job_spec_json).adapters
    if adapters is not None and any(".lora_" in name for name in tensors):
        tensors = merge_adapters(tensors, adapters)
    metadata = {"job_id": header.job_id, "round": str(header.round), "model_version": str(header.version),
                "model_spec_json": header.model_spec_json}
    files = {"model": out / MODEL_FILE, "model_spec": out / SPEC_FILE, "job": out / JOB_FILE,
             "readme": out / README_FILE}
    write_atomic(files["model"], safetensors.numpy.save(
        {name: np.ascontiguousarray(arr) for name, arr in tensors.items()}, metadata=metadata))
    write_atomic(files["model_spec"], (json.dumps(json.loads(header.model_spec_json), indent=2) + "\n").encode())
    write_atomic(files["job"], (json.dumps(json.loads(job_spec_json), indent=2) + "\n").encode())
    snippet = LOAD_SNIPPET.format(spec=SPEC_FILE, model=MODEL_FILE)
    write_atomic(files["readme"], (
        f"# {header.job_id}, round {header.round} (global model version {header.version})\n\n"
        f"- `{MODEL_FILE}`: the weights (safetensors; tensor names are the model's `state_dict` keys"
        f"{'; LoRA adapters merged into their targets, a plain model' if adapters is not None else ''})\n"
        f"- `{SPEC_FILE}`: the model spec the weights belong to (alignment may have grown a layer)\n"
        f"- `{JOB_FILE}`: the job as it was submitted\n\n"
        f"{input_section(header.model_spec_json, job_spec_json)}\n"
        f"{output_section(header.model_spec_json, job_spec_json)}\n"
        f"Load it into a torch model (run this in this folder, with the `fedbroker` package installed):\n\n"
        f"```python\n{snippet}```\n"
        f"{_then(data_section(header.model_spec_json, job_spec_json, job_file=JOB_FILE))}").encode())
    return {k: str(v) for k, v in files.items()}


def _then(section: str) -> str:
    return f"\n{section}" if section else ""


def _job_plan(job_spec_json: str) -> ModelPlan:
    """The job's model plan from its stored form (the default plan when it has none or it cannot be read)."""
    errors = Collector()
    try:
        plan = parse_plan(json.loads(job_spec_json or "{}").get("model"), errors=errors)
    except (ValueError, AttributeError):
        return ModelPlan()
    return ModelPlan() if errors.errors else plan


def cmd_download(args: argparse.Namespace) -> int:
    """`jobs download ID --out DIR`: a round's global model with its spec, the job and a README."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():  # refused before the download, not as a traceback after it
        raise ConfigError("--out", f"{out} is a file; give a folder (it is created if missing)")
    with client(args) as c:
        chosen = best(c.status(args.job_id), args.job_id) if args.best else None
        header, tensors = c.download(args.job_id, chosen[0] if chosen else args.round or 0)
        (job,) = c.status(args.job_id).jobs
    files = write_model(Path(args.out), header, tensors, job.spec_json)
    if chosen:
        print(f"round {chosen[0]} is the best by {chosen[2]} accuracy ({chosen[1]:.4f})", file=sys.stderr)
    if args.json:
        print(json.dumps({"job_id": header.job_id, "round": header.round, "model_version": header.version,
                          "files": files, **({"best_by": chosen[2], "accuracy": chosen[1]} if chosen else {})},
                         indent=2))
    else:
        print(f"round {header.round} of {header.job_id} (version {header.version}) written to {args.out}: "
              f"{MODEL_FILE}, {SPEC_FILE}, {JOB_FILE}, {README_FILE}")
    return 0


def round_number(text: str) -> int:
    """An argparse type: a round as the wire carries it (int32), so a bad one is a usage error, not a traceback."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value <= MAX_ROUND:
        raise argparse.ArgumentTypeError(f"{value} is not a round: 1 to {MAX_ROUND} (0 = the last closed one)")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> Callable[..., argparse.ArgumentParser]:
    """`fedbroker jobs ...` under the main parser's subcommands; returns the function that adds a verb (with
    --coordinator, --config, --json), for verbs that live elsewhere (`jobs track`: fedbroker.app.tracking)."""
    jobs = sub.add_parser("jobs", help="list, show, cancel, follow, download and track your jobs")
    verbs = jobs.add_subparsers(dest="verb", required=True)

    def verb(name: str, fn: Callable[[argparse.Namespace], int], help_text: str, *, job_id: bool = True,
             read: bool = True) -> argparse.ArgumentParser:
        p = verbs.add_parser(name, help=help_text)
        if job_id:
            p.add_argument("job_id", metavar="ID")
        p.add_argument("--coordinator", help="host:port of the coordinator, or several comma-separated (a standby is passed over; default: coordinator.targets, else coordinator.target)")
        p.add_argument("--config", help="YAML config with the client section (token, CA) and coordinator.target")
        if read:
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(run=fn)
        return p

    verb("list", cmd_list, "every job: status, rounds, submitter", job_id=False)
    verb("show", cmd_show, "one job: its settings, rounds and participants")
    verb("cancel", cmd_cancel, "cancel a job you submitted (its open round is abandoned, never closed)")
    logs = verb("logs", cmd_logs, "the job's events (round opened, uploads, refusals, closes, the end)")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing events until the job ends")
    download = verb("download", cmd_download, "a round's (default: the last) global model, as safetensors")
    which = download.add_mutually_exclusive_group()
    which.add_argument("--round", type=round_number, default=0, help="the round (default: the last closed one)")
    which.add_argument("--best", action="store_true", help="the round with the best federated accuracy (the sites' "
                                                           "scores), else the best on the job's evaluation set")
    download.add_argument("--out", required=True, help="folder to write the model, its spec and a README into")
    return verb

