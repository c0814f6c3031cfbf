"""The `fedbroker workers` verbs: an operator's audited correction of the ε the coordinator recorded for a worker.

The coordinator keeps the highest ε a worker ever reported and every task carries it; a worker whose ledger
holds less refuses to train. A record that is wrong (a report forged before the control queue bound messages
to their senders, ε spent outside the coordinator's tasks) is corrected here, with the site's own ledger as the
evidence: the ledger must name the worker, and the record is never set below the ε it holds nor below what the
coordinator's own participant rows priced for the worker (a ledger emptied of jobs is refused). Each correction is
kept in the state store's audit trail (who, when, from what to what, the ledger's digest), shown by
`fedbroker workers corrections`.

It works on the coordinator's state folder, which a running coordinator holds locked: stop the coordinator,
correct, start it again (deploy/SECURITY.md, "Correcting a worker's recorded ε").
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import time

from fedbroker.errors import ConfigError, NotFound


def ledger_evidence(path: str, worker_id: str) -> tuple[float, str]:
    """(ε the ledger holds, SHA-256 of the file): refused unless it is a readable ledger naming `worker_id`."""
    from fedbroker.worker.ledger import PrivacyLedger

    try:
        with open(path, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        raise ConfigError("--ledger", f"cannot read {path}: {exc}") from None
    ledger = PrivacyLedger(path)  # its format, and its mark file where one lies beside it
    if ledger.worker_id is None:
        raise ConfigError("--ledger", f"{path} names no worker (a worker writes its id into its ledger when it "
                                      f"starts, from this version on): start worker {worker_id!r} once, then "
                                      f"send its ledger again")
    if ledger.worker_id != worker_id:
        raise ConfigError("--ledger", f"{path} is the ledger of worker {ledger.worker_id!r}, not of {worker_id!r}")
    return ledger.total_epsilon(), digest


def reset_epsilon(state_dir: str, worker_id: str, *, ledger_path: str, by: str, epsilon: float | None = None,
                  note: str = "") -> tuple[float, float]:
    """Set the ε recorded for `worker_id` to `epsilon` (default: its ledger's), never below its ledger's nor what
    the coordinator priced for it (`StateStore.priced_epsilon`), and audit it; (old, new). Refused while a coordinator holds `state_dir` (StateDirInUse)."""
    from fedbroker.coordinator.store import StateStore
    from fedbroker.worker.ledger import below

    spent, digest = ledger_evidence(ledger_path, worker_id)
    new = spent if epsilon is None else epsilon
    if not new < float("inf") or below(new, spent):
        raise ConfigError("--epsilon", f"{new:.6g} is below the ε {spent:.6g} the ledger of {worker_id!r} holds: "
                                       f"a record below the site's own ledger would let it spend that ε again")
    store = StateStore.in_directory(state_dir)
    try:
        if store.recorded_epsilon(worker_id) is None:
            raise NotFound(f"no worker {worker_id!r} is registered in {state_dir}")
        priced = store.priced_epsilon(worker_id)
        if below(new, priced):
            raise ConfigError("--ledger", f"the ε {new:.6g} to record is below the ε {priced:.6g} this coordinator "
                                          f"recorded for {worker_id!r} from the tasks it priced (its participant "
                                          f"rows, `fedbroker ledger` on the site lists them): a ledger emptied of "
                                          f"jobs would let the site spend that ε again; restore its full ledger")
        correction = store.correct_epsilon(worker_id, epsilon=new, by=by, ledger_sha256=digest, ledger_epsilon=spent,
                                           note=note)
    finally:
        store.close()
    if correction is None:
        raise NotFound(f"no worker {worker_id!r} is registered in {state_dir}")
    return correction.old, correction.new


def cmd_reset_epsilon(args: argparse.Namespace) -> int:
    """`workers reset-epsilon WORKER --ledger FILE --state-dir DIR`: correct the record, say from what to what."""
    old, new = reset_epsilon(args.state_dir, args.worker, ledger_path=args.ledger, by=args.by, epsilon=args.epsilon,
                             note=args.note)
    print(f"worker {args.worker}: recorded ε {old:.6g} → {new:.6g} (by {args.by}, from {args.ledger}); the "
          f"correction is in the audit trail (`fedbroker workers corrections`)")
    return 0


def cmd_corrections(args: argparse.Namespace) -> int:
    """`workers corrections --state-dir DIR [WORKER]`: the audit trail, oldest first (JSON lines with --json)."""
    from fedbroker.coordinator.store import StateStore

    store = StateStore.in_directory(args.state_dir)
    try:
        rows = store.epsilon_corrections(args.worker)
    finally:
        store.close()
    for c in rows:
        if args.json:
            print(json.dumps({"worker_id": c.worker_id, "time": c.time, "by": c.by, "old": c.old, "new": c.new,
                              "ledger_sha256": c.ledger_sha256, "ledger_epsilon": c.ledger_epsilon, "note": c.note}))
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c.time))
            print(f"{when}Z  {c.worker_id}  ε {c.old:.6g} → {c.new:.6g}  by {c.by}  ledger ε {c.ledger_epsilon:.6g} "
                  f"sha256 {c.ledger_sha256[:16]}…{'  ' + c.note if c.note else ''}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker workers reset-epsilon | corrections` under the main parser's subcommands."""
    workers = sub.add_parser("workers", help="correct the ε the coordinator recorded for a worker (audited)")
    verbs = workers.add_subparsers(dest="workers_command", required=True)
    reset = verbs.add_parser("reset-epsilon", help="set a worker's recorded ε from its site's ledger (coordinator "
                                                   "stopped)")
    reset.add_argument("worker", help="the worker id")
    reset.add_argument("--ledger", required=True, help="the site's ledger.json (it must name the worker)")
    reset.add_argument("--state-dir", required=True, help="the coordinator's state folder (coordinator.state_dir)")
    reset.add_argument("--epsilon", type=float, help="the ε to record (default: the ledger's; never below it)")
    reset.add_argument("--by", default=getpass.getuser(), help="who corrects it, for the audit trail "
                                                              "(default: this login)")
    reset.add_argument("--note", default="", help="why, for the audit trail")
    reset.set_defaults(run=cmd_reset_epsilon)
    listing = verbs.add_parser("corrections", help="the audit trail of ε corrections")
    listing.add_argument("worker", nargs="?", help="one worker's only")
    listing.add_argument("--state-dir", required=True, help="the coordinator's state folder")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(run=cmd_corrections)
