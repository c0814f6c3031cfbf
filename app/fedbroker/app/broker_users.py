"""`fedbroker broker sync`: make a running RabbitMQ's users what the server kit's `rabbitmq/definitions.json` says,
without restarting it.

Every participant logs in to the broker as its own user (`<project>-<name>`, a password, over mutual TLS). The
broker reads `definitions.json` only when it starts, so after `fedbroker provision add`, `revoke` or a password
change the running broker still knows the old users. This command applies the file to the running node:

1. every user of the project the broker has and the file no longer lists is deleted (no new login), and every
   connection it has open is closed, which ends its consumers and publishers at once (CONNECTION_FORCED).
   RabbitMQ 3.10 closes a deleted user's connections itself ("user ... is deleted"); the command asks for it
   explicitly too (`close_all_user_connections`), so the close does not rest on that;
2. the file is imported (`import_definitions`): new participants' users and permissions, changed password
   hashes (a new password is needed from the next login on; connections already open stay open).

It speaks to the node with `rabbitmqctl` (the node's Erlang cookie, so it runs on the broker's host or through
`kubectl exec`), which needs no broker user of its own and works whether or not the management plugin is on.
A host kit's broker is a node of its own (`--node fedbroker-<project>@localhost`, as its start-broker.sh names
it), so the line `provision` prints never reaches the host's default RabbitMQ node.
A user is the project's when its name starts with `<project>-`; users of another project whose name starts
the same way (`<project>-x-coordinator`, a project named `<project>-x`), administrators and users outside the
prefix are never touched. `--dry-run` prints the plan and changes nothing.

With `--crl` and `--crl-dir` it first installs the server kit's CRL where the broker checks client certificates
(fedbroker.app.broker_crl), so a revoked certificate gets no TLS handshake at the broker either.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fedbroker.errors import BusError, ConfigError
from fedbroker.files import read_setting_file

CTL_TIMEOUT_S = 120.0
CLOSE_REASON = "fedbroker: this participant's access was revoked"


@dataclass(frozen=True)
class Plan:
    """What `sync` does: the users it deletes (and disconnects), and the users the import adds or updates."""

    prefix: str
    delete: tuple[str, ...]
    import_users: tuple[str, ...]
    new: tuple[str, ...]           # among import_users, those the broker does not have yet
    spared: tuple[str, ...] = ()   # users under the prefix left alone: another project's (a longer name)


def read_definitions(path: str) -> dict[str, Any]:
    """A kit's definitions.json, checked to hold a list of named users (what the import and the plan read)."""
    text = read_setting_file(path, field="definitions")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("definitions", f"{path} is not JSON: {exc}") from None
    users = raw.get("users") if isinstance(raw, dict) else None
    if not isinstance(users, list) or not all(isinstance(u, dict) and isinstance(u.get("name"), str) and u["name"]
                                              for u in users):
        raise ConfigError("definitions", f"{path} needs a 'users' list of objects with a 'name' (a kit's "
                                         f"rabbitmq/definitions.json)")
    return cast("dict[str, Any]", raw)


def project_prefix(definitions: Mapping[str, Any], project: str = "") -> str:
    """`<project>-`: given, or read off the one `<project>-coordinator` user the kit's definitions hold."""
    names: list[str] = [u["name"] for u in definitions["users"]]
    if not project:
        found = sorted({n[: -len("coordinator")] for n in names if n.endswith("-coordinator")})
        if len(found) != 1:
            raise ConfigError("--project", f"cannot tell the project from the definitions' users {names} (one "
                                           f"'<project>-coordinator' expected): name it with --project")
        return found[0]
    prefix = f"{project}-"
    outside = [n for n in names if not n.startswith(prefix)]
    if outside:
        raise ConfigError("--project", f"the definitions hold users outside project {project!r}: {outside}")
    return prefix


def make_plan(definitions: Mapping[str, Any], present: Mapping[str, Sequence[str]], prefix: str) -> Plan:
    """The plan for a broker whose users are `present` (name → tags)."""
    wanted = [u["name"] for u in definitions["users"]]
    # `<prefix>x-coordinator` is the coordinator of a project named `<prefix>x`: its users are not ours
    others = {n[: -len("coordinator")] for n in present if n.endswith("-coordinator") and n not in wanted}
    others = {p for p in others if p.startswith(prefix) and p != prefix}
    delete: list[str] = []
    spared: list[str] = []
    for name, tags in sorted(present.items()):
        if not name.startswith(prefix) or name in wanted or "administrator" in tags:
            continue
        (spared if any(name.startswith(p) for p in others) else delete).append(name)
    return Plan(prefix, tuple(delete), tuple(wanted), tuple(n for n in wanted if n not in present), tuple(spared))


class Ctl:
    """`rabbitmqctl` as this machine reaches the node: a command line (`kubectl exec -i ... -- rabbitmqctl`), and the
    node's name (`node`: `-n NAME`; none: rabbitmqctl's default node, the host's own RabbitMQ)."""

    def __init__(self, command: Sequence[str], *, node: str = "", env: Mapping[str, str] | None = None) -> None:
        if not command:
            raise ConfigError("--rabbitmqctl", "is empty")
        self.command = [*command, "-n", node] if node else list(command)
        self.env = dict(env) if env is not None else None

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        """Its output; BusError naming the command and what it said when it fails."""
        line = [*self.command, *args]
        try:
            done = subprocess.run(line, input=stdin, capture_output=True, text=True, timeout=CTL_TIMEOUT_S,
                                  env=self.env)
        except FileNotFoundError:
            raise BusError(f"{self.command[0]} not found: pass --rabbitmqctl (e.g. 'kubectl exec -i -n fedbroker "
                           f"rabbitmq-0 -- rabbitmqctl')") from None
        except subprocess.TimeoutExpired:
            raise BusError(f"{shlex.join(line)} did not answer in {CTL_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip()[-1500:]
            raise BusError(f"{shlex.join(line)} failed ({done.returncode}): {said}")
        return done.stdout

    def users(self) -> dict[str, list[str]]:
        """The node's users and their tags."""
        out = self("list_users", "--formatter", "json", "--quiet")
        try:
            rows = json.loads(out)
            return {str(r["user"]): [str(t) for t in (r.get("tags") or [])] for r in rows}
        except (ValueError, KeyError, TypeError) as exc:
            raise BusError(f"cannot read the node's users from list_users: {exc}: {out[:300]!r}") from None


def sync(definitions_path: str, ctl: Ctl, *, project: str = "", dry_run: bool = False) -> Plan:
    """Apply the definitions to the node `ctl` reaches (module docstring); the plan it carried out."""
    definitions = read_definitions(definitions_path)
    prefix = project_prefix(definitions, project)
    plan = make_plan(definitions, ctl.users(), prefix)
    if dry_run:
        return plan
    for user in plan.delete:   # revocation first: it is the urgent part
        ctl("delete_user", user)
        ctl("close_all_user_connections", user, CLOSE_REASON)
    with open(definitions_path, encoding="utf-8") as fh:
        ctl("import_definitions", "--format", "json", stdin=fh.read())   # no file: stdin (3.10 takes no "-")
    return plan


def cmd_sync(args: argparse.Namespace) -> int:
    """Print the plan, and carry it out unless --dry-run."""
    if bool(args.crl) != bool(args.crl_dir):
        raise ConfigError("--crl-dir" if args.crl else "--crl", "--crl and --crl-dir go together")
    if args.crl and not args.dry_run:   # first: from now on a revoked certificate gets no TLS handshake
        from fedbroker.app.broker_crl import install_crl

        print(f"installed {args.crl} as {install_crl(args.crl, args.crl_dir)}")
    elif args.crl:
        print(f"would install {args.crl} in {args.crl_dir}")
    ctl = Ctl(shlex.split(args.rabbitmqctl), node=args.node)
    plan = sync(args.definitions, ctl, project=args.project, dry_run=args.dry_run)
    would = "would " if args.dry_run else ""
    for user in plan.delete:
        print(f"{would}delete and disconnect {user}")
    for user in plan.new:
        print(f"{would}add {user}")
    for user in plan.spared:
        print(f"leave {user} alone (another project's name)")
    print(f"{would}import {len(plan.import_users)} user(s) of {plan.prefix}* (passwords and permissions as the file "
          f"says)")
    return 0


def add_parser(sub: Any) -> None:
    """`fedbroker broker sync`."""
    broker = sub.add_parser("broker", help="apply a server kit's broker users to the running RabbitMQ")
    verbs = broker.add_subparsers(dest="broker_command", required=True, metavar="VERB")
    p = verbs.add_parser("sync", help="delete (and disconnect) revoked users, add new ones, no restart")
    p.add_argument("definitions", help="the server kit's rabbitmq/definitions.json")
    p.add_argument("--rabbitmqctl", default="rabbitmqctl",
                   help="how to run rabbitmqctl against the node (default: rabbitmqctl; in Kubernetes e.g. "
                        "'kubectl exec -i -n fedbroker rabbitmq-0 -- rabbitmqctl')")
    p.add_argument("--node", default="",
                   help="the node's name (rabbitmqctl -n): a host kit's broker is its own node, fedbroker-<project>"
                        "@localhost (start-broker.sh); default: rabbitmqctl's, the host's default RabbitMQ")
    p.add_argument("--project", default="", help="the project's name (default: read off '<project>-coordinator')")
    p.add_argument("--crl", default="", help="the server kit's crl.pem: also install it where the broker checks it")
    p.add_argument("--crl-dir", default="", help="the folder of the broker's crl_cache (ssl_crl_hash_dir), on its host")
    p.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    p.set_defaults(run=cmd_sync)
