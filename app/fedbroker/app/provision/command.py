"""The `fedbroker provision` verb (registered by fedbroker.app.cli): `provision project.yaml --out DIR` the first
time, then `provision add|renew|revoke|rotate-token|show --out DIR` on the same folder."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedbroker.app.provision import lifecycle
from fedbroker.app.provision.configs import CRL_DIR, broker_node
from fedbroker.app.provision.kits import provision
from fedbroker.app.provision.project import MAX_PROJECT_BYTES, load_project
from fedbroker.app.provision.serverkit import CRL_FILE, DEFINITIONS
from fedbroker.app.provision.state import Kind, Standing
from fedbroker.errors import ConfigError
from fedbroker.job.yamltext import load_yaml

K8S_RABBITMQCTL = "kubectl exec -i -n fedbroker rabbitmq-0 -- rabbitmqctl"
FIRST = "new"   # `provision project.yaml` is `provision new project.yaml`


def cmd_provision(args: argparse.Namespace) -> int:
    """Provision the project and say where each kit went, and which folder must stay with the operator."""
    project = load_project(args.project)
    kits = provision(project, args.out)
    print(f"provisioned {project.name} into {args.out}:")
    for who, folder in kits.items():
        print(f"  {who:<28} {folder}")
    print("hand each participant its own folder only; ca/ (the CA's key) and provision-state.json stay with you")
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    """One new kit under the project's CA; the server kit's files that accept it are updated in place."""
    if args.site:
        entry: dict[str, Any] = {"name": args.site}
        if args.category:
            entry["categories"] = list(args.category)
        if args.worker:
            entry["worker"] = _worker_settings(args.worker)
        folder = lifecycle.add(args.out, site=entry)
    else:
        folder = lifecycle.add(args.out, scientist={"name": args.scientist, "role": args.role})
    print(f"issued {folder}: hand it to its participant only")
    print(f"updated {Path(args.out) / 'server'}: tokens/*.yaml" + (", rabbitmq/definitions.json, coordinator.yaml, "
                                                                   "k8s/config.yaml" if args.site else ""))
    print(_APPLY)
    if args.site:
        _print_sync(args.out, "its broker user, so that its worker can log in", crl=False)
        _apply_broker(args, crl=False)
    return 0


def cmd_renew(args: argparse.Namespace) -> int:
    """New certificates (new keys) under the same CA; tokens only with --new-tokens."""
    renewed = lifecycle.renew(args.out, name=args.name, new_tokens=args.new_tokens, revoke_old=args.revoke_old,
                              days=args.days)
    for who in renewed:
        until = min(c.not_after for c in who.current())
        print(f"renewed {who.name:<24} {who.kit:<28} valid until {until}")
    if args.name is None:
        print("the CA's certificate was renewed too (same key): every kit's ca.crt changed")
    print("hand each renewed kit's tls/ (and ca.crt" + (", secrets/" if args.new_tokens else "")
          + ") to its participant; " + _APPLY)
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    """Revoke one participant: CRL, token tables, broker user."""
    who, before = lifecycle.revoke(args.out, name=args.name, reason=args.reason)
    serials = ", ".join(c.serial for c in who.certificates)
    if before:
        print(f"{who.name} was revoked already ({who.revoked_at}); the server kit was checked and left so")
    else:
        print(f"revoked {who.name} ({args.reason}): certificate serial(s) {serials} in server/{CRL_FILE}")
    print("its token is out of the server's token tables" + (f" and its broker user {who.broker_user} out of "
                                                             f"rabbitmq/definitions.json" if who.broker_user else ""))
    print(_APPLY)
    _print_sync(args.out, "the CRL and, for a site, the deletion of its broker user (its connections closed)",
                crl=True)
    _apply_broker(args, crl=True)
    return 0


def cmd_rotate(args: argparse.Namespace) -> int:
    """The two steps of a token rotation."""
    who = lifecycle.rotate_token(args.out, name=args.name, finish=args.finish)
    if args.finish:
        print(f"rotation of {who.name}'s token finished: only the new token is accepted now")
    else:
        token = "secrets/coordinator.token" if who.kind is Kind.SERVER else "secrets/token"
        print(f"a new token for {who.name} is in {Path(args.out) / who.kit / token}; the server accepts the old "
              f"and the new one until `fedbroker provision rotate-token --out {args.out} --name {who.name} --finish`")
    print(_APPLY)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """What was issued: every participant, its status, certificates and tokens (digests counted, never shown)."""
    record = lifecycle.summary(args.out)
    print(f"project {record.project['name']}, CRL number {record.crl_number}")
    print(f"{'name':<24} {'kind':<10} {'role':<12} {'status':<8} {'serial':<42} {'not after':<26} tokens")
    for who in record.participants.values():
        current = who.current() or who.certificates[-1:]
        first = current[0] if current else None
        tokens = "-" if who.status is Standing.REVOKED else f"{len(who.tokens_sha256)}" + (" (rotating)" if who.rotating_from
                                                                                   else "")
        print(f"{who.name:<24} {who.kind:<10} {who.role:<12} {who.status:<8} {first.serial if first else '-':<42} "
              f"{first.not_after if first else '-':<26} {tokens}")
    return 0


_APPLY = ("on Kubernetes, `kubectl apply -k server/` carries the server kit's changes to the cluster; on a host the "
          "services read the changed files as they do (see deploy/OPERATING.md, \"Month three\")")


def sync_command(out: str | Path, *, crl: bool, rabbitmqctl: str = "") -> list[str]:
    """`fedbroker broker sync` for the server kit under `out`, as the broker's host runs it: the kit's users,
    and (`crl`) its CRL into the folder the kit's advanced.config names, on the kit's own node (start-broker.sh's,
    never the host's default one). `rabbitmqctl`: how to reach the node instead (Kubernetes: the pod's only node)."""
    server = Path(out) / "server"
    line = ["fedbroker", "broker", "sync", str(server / DEFINITIONS)]
    if crl:
        line += ["--crl", str(server / CRL_FILE), "--crl-dir", str(server / CRL_DIR)]
    if rabbitmqctl:
        return line + ["--rabbitmqctl", rabbitmqctl]
    return line + ["--node", broker_node(lifecycle.summary(out).to_project())]


def _print_sync(out: str | Path, what: str, *, crl: bool) -> None:
    """The exact commands that carry `what` to a running broker: a broker reads its users only when it starts."""
    print(f"a running broker needs {what}: on the broker's host (paths as there, as the user that runs "
          f"start-broker.sh), run")
    print(f"  {shlex.join(sync_command(out, crl=crl))}")
    print(f"on Kubernetes, after `kubectl apply -k {Path(out) / 'server'}`:")
    print(f"  {shlex.join(sync_command(out, crl=False, rabbitmqctl=K8S_RABBITMQCTL))}")


def _apply_broker(args: argparse.Namespace, *, crl: bool) -> None:
    """With --apply-broker: run that `broker sync` here, on the broker's host (the kit's files are the broker's
    own, and `--rabbitmqctl` reaches the kit's node by its name). The kit has changed by then: if the sync fails, the command fails
    saying why, and the printed line applies the change once the broker is reachable."""
    if not args.apply_broker:
        return
    from fedbroker.app.broker_users import cmd_sync

    line = sync_command(args.out, crl=crl)
    print("applying it to the running broker:")
    cmd_sync(argparse.Namespace(definitions=line[3], rabbitmqctl=args.rabbitmqctl, node=line[-1], project="",
                                dry_run=False, crl=line[5] if crl else "", crl_dir=line[7] if crl else ""))


def _worker_settings(path: str) -> dict[str, Any]:
    """A site's worker settings (as sites[i].worker in project.yaml) from a YAML file."""
    with open(path, "rb") as fh:
        raw = load_yaml(fh.read(MAX_PROJECT_BYTES + 1), where=path, max_bytes=MAX_PROJECT_BYTES)
    if not isinstance(raw, Mapping):
        raise ConfigError("--worker", f"{path} must be a mapping of worker settings, as sites[i].worker in "
                                      f"project.yaml")
    return dict(raw)


def _broker_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--apply-broker", action="store_true",
                        help="on the broker's host: also run the `fedbroker broker sync` it prints (a site's broker "
                             "user, the CRL) against the running RabbitMQ")
    parser.add_argument("--rabbitmqctl", default="rabbitmqctl",
                        help="with --apply-broker: how to run rabbitmqctl on the broker's host (default: rabbitmqctl; "
                             "it is given the kit's node, -n fedbroker-<project>@localhost)")


class _AnyVerb(Mapping[str, argparse.ArgumentParser]):
    """The verbs' parsers, as argparse checks a choice against them: any first word passes the check, so that
    `provision project.yaml` reaches `_VerbOrProject`, which reads it as `provision new project.yaml`."""

    def __init__(self, parsers: dict[str, argparse.ArgumentParser]) -> None:
        self.parsers = parsers

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        return self.parsers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parsers)

    def __len__(self) -> int:
        return len(self.parsers)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)


class _VerbOrProject(argparse._SubParsersAction):  # type: ignore[type-arg]
    """`provision VERB ...`, where a first word that is no verb is the project file of `provision new`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.choices = _AnyVerb(self._name_parser_map)  # type: ignore[assignment]

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        words = list(values or [])
        if words and words[0] not in self._name_parser_map:
            words = [FIRST, *words]
        super().__call__(parser, namespace, words, option_string)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker provision [new] project.yaml --out DIR`, and its later verbs, under the main parser."""
    p = sub.add_parser("provision", help="write one kit per participant from project.yaml; later add, renew, "
                                         "revoke, rotate-token")
    verbs = p.add_subparsers(action=_VerbOrProject, dest="provision_verb", required=True, metavar="VERB")

    def verb(name: str, run: Any, help_text: str) -> argparse.ArgumentParser:
        parser = verbs.add_parser(name, help=help_text)
        parser.add_argument("--out", required=True, help="the folder `fedbroker provision project.yaml --out` wrote"
                            if name != FIRST else "a new folder for the kits")
        parser.set_defaults(run=run)
        return parser

    first = verb(FIRST, cmd_provision, "the first time: the CA, every kit and the record (the default verb)")
    first.add_argument("project", help="project.yaml: name, server (host, ports), sites, scientists")
    add = verb("add", cmd_add, "one new site or scientist under the same CA")
    who = add.add_mutually_exclusive_group(required=True)
    who.add_argument("--site", help="the new site's name (its worker id)")
    who.add_argument("--scientist", help="the new data scientist's name")
    add.add_argument("--category", action="append", help="a data category the site serves (repeat; default digits)")
    add.add_argument("--worker", help="a YAML file of the site's worker settings (as sites[i].worker in project.yaml)")
    add.add_argument("--role", choices=["submitter", "viewer"], default="submitter", help="a scientist's role")
    _broker_options(add)
    renew = verb("renew", cmd_renew, "new certificates (new keys) under the same CA, tokens kept")
    renew.add_argument("--name", help="one participant only (default: all, and the CA's own certificate)")
    renew.add_argument("--new-tokens", action="store_true", help="new tokens too (the old ones stop at once)")
    renew.add_argument("--revoke-old", action="store_true", help="list the replaced certificates in the CRL")
    renew.add_argument("--days", type=int, help="how long the new certificates last (default: validity_days)")
    revoke = verb("revoke", cmd_revoke, "revoke a participant: CRL, token tables, broker user")
    revoke.add_argument("--name", required=True)
    revoke.add_argument("--reason", choices=lifecycle.REASONS, default="unspecified")
    _broker_options(revoke)
    rotate = verb("rotate-token", cmd_rotate, "a new token beside the old one; --finish retires the old one")
    rotate.add_argument("--name", required=True)
    rotate.add_argument("--finish", action="store_true", help="step 2: the old token is refused from now on")
    verb("show", cmd_show, "what was issued: participants, status, serials, validity")
