"""The one command line, `fedbroker VERB`: `fedbroker --help` lists every verb (fedbroker.app.help).

Exit codes and error lines follow one convention (fedbroker.app.exits): 0 ok, 1 refused by a service, 2 usage
or local validation; each error is one line, `fedbroker VERB: ORIGIN: message`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from fedbroker.app.exits import Parser, report
from fedbroker.app.logs import setup_logging
from fedbroker.errors import ConfigError
from fedbroker.version import installed_version

if TYPE_CHECKING:
    from typing import TypeAlias

    from fedbroker.app.demo import DemoOptions
    from fedbroker.config import Config
    from fedbroker.coordinator.service import CoordinatorClient
    from fedbroker.worker.secure_task import SecureSteps

    Subcommands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

def _config(args: argparse.Namespace, overrides: dict[str, Any]) -> Config:
    from fedbroker.config import load_config

    config = load_config(getattr(args, "config", None), overrides=overrides)
    setup_logging(config.log_level)  # pika at WARNING unless log_level is DEBUG
    return config


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def cmd_aggregator(args: argparse.Namespace) -> int:
    """Serve uploads until SIGINT or SIGTERM, then let the calls in flight finish (5 s grace)."""
    from fedbroker.app.launch import start_aggregator

    server, _port = start_aggregator(_config(args, {"aggregator.listen": args.listen}))
    _wait_for_signal()
    server.stop(grace=5)
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    """Run jobs until SIGINT or SIGTERM; the flags override the config file and FEDBROKER__ variables."""
    from fedbroker.app.launch import start_coordinator

    overrides = {"broker.url": args.broker, "coordinator.listen": args.listen, "aggregator.target": args.aggregator,
                 "coordinator.state_dir": args.state_dir}
    process = start_coordinator(_config(args, overrides), config_file=args.config, overrides=overrides)
    _wait_for_signal()
    process.stop()
    return 0


def cmd_worker(args: argparse.Namespace, *, secure_steps: SecureSteps | None = None) -> int:
    """Serve one data owner's tasks until SIGINT or SIGTERM; only over a real broker (a process of its own).
    `secure_steps`: a test's observer of the secure steps (tests/integration/secure_worker.py); never from here."""
    from fedbroker.app.launch import broker_url, start_worker
    from fedbroker.app.unfilled import refuse_unfilled

    config = _config(args, {"broker.url": args.broker, "worker.id": args.id})
    refuse_unfilled(config.worker, args.config or "the worker's settings")  # a kit's data left FILL-IN
    if not broker_url(config):  # broker.url or broker.url_file (a kit's secrets/broker-url)
        raise ConfigError("broker.url", "a worker process needs a broker (amqp://...); the in-process bus "
                                        "only works inside `fedbroker demo`")
    agent = start_worker(config, secure_steps=secure_steps)
    _wait_for_signal()
    agent.stop()
    agent.bus.close()
    return 0


def _coordinator_client(args: argparse.Namespace) -> CoordinatorClient:
    """A client with this user's token and TLS from --config or FEDBROKER__CLIENT__* (TOKEN_FILE, CA_FILE, ...)."""
    from fedbroker.app.jobs import client

    return client(args)


def cmd_status(args: argparse.Namespace) -> int:
    """Print the coordinator's jobs, rounds and workers (one job with --job), as tables or --json."""
    from fedbroker.app.jobs import as_dict
    from fedbroker.app.status import render

    client = _coordinator_client(args)
    status = client.status(args.job or "")  # an unknown --job is NOT_FOUND: exit 1, naming it
    client.close()
    print(json.dumps(as_dict(status), indent=2) if args.json else render(status))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """A whole federation on this machine, from the flags (fedbroker.app.demo)."""
    from fedbroker.app.demo import DemoOptions, run_demo

    setup_logging(logging.WARNING)
    options = DemoOptions(
        workers=args.workers, rounds=args.rounds, alpha=args.alpha, partition=args.partition, dp=args.dp,
        dataset=args.dataset, broker=args.broker or "", out=args.out, seed=args.seed,
        local_epochs=args.local_epochs, lr=args.lr, noise_multiplier=args.noise_multiplier,
        max_grad_norm=args.max_grad_norm, epsilon_budget=args.epsilon_budget, mode=args.mode, track=args.track,
        experiment=args.experiment,
    )
    run_demo(options)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """The same federation with and without DP, each attacked (fedbroker.app.audit)."""
    from pathlib import Path

    from fedbroker.app.audit import run_audit
    from fedbroker.app.demo import DemoOptions

    setup_logging(logging.WARNING)
    options = DemoOptions(workers=args.workers, rounds=args.rounds, local_epochs=args.local_epochs, hidden=args.hidden,
                          partition=args.partition, dataset=args.dataset, broker=args.broker or "",
                          noise_multiplier=args.noise_multiplier, epsilon_budget=args.epsilon_budget, lr=args.lr)
    run_audit(options, Path(args.out) / f"audit-{options.run_id}")
    return 0


def cmd_token(args: argparse.Namespace) -> int:
    """A new token for one identity, and the digest entry its service's token table needs (never the token)."""
    from fedbroker.rpc.auth import TokenTable, generate_token, hash_token

    token = generate_token()
    entry = {args.identity: {"role": args.role, "sha256": hash_token(token)}}
    TokenTable.from_mapping(entry)  # the identity and role are valid
    print(f"# the token: give it to {args.identity} only (its FEDBROKER__CLIENT__TOKEN or client.token_file)")
    print(token)
    print("# its entry in the service's token table (tokens_file)")
    print(f"{args.identity}:\n  role: {args.role}\n  sha256: {entry[args.identity]['sha256']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Every verb's arguments; each verb's `run` is the function `main` calls."""
    from fedbroker.app import help as listing
    from fedbroker.app.backup import add_parser as add_backup_parser
    from fedbroker.app.broker_users import add_parser as add_broker_parser
    from fedbroker.app.demo import DemoOptions
    from fedbroker.app.jobs import add_parser as add_jobs_parser
    from fedbroker.app.ledger import add_parser as add_ledger_parser
    from fedbroker.app.models import add_parser as add_models_parser
    from fedbroker.app.new import add_parser as add_new_parser
    from fedbroker.app.provision.command import add_parser as add_provision_parser
    from fedbroker.app.simulate_cli import add_simulate
    from fedbroker.app.sites import add_parser as add_sites_parser
    from fedbroker.app.submit import add_parser as add_submit_parser
    from fedbroker.app.teardown import add_parser as add_teardown_parser
    from fedbroker.app.tracking import add_jobs_track
    from fedbroker.app.workers import add_parser as add_workers_parser

    defaults = DemoOptions()
    parser = Parser(prog="fedbroker", usage="%(prog)s [-h] [--version] COMMAND ...")
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    # the verbs are listed by fedbroker.app.help (grouped, in the epilog), not by argparse's one long line
    sub = cast("Subcommands", parser.add_subparsers(prog="fedbroker", dest="command", required=True, metavar="COMMAND",
                                                    help=argparse.SUPPRESS))  # its verbs are Parsers too
    _add_demo(sub, defaults)
    add_new_parser(sub)
    _add_services(sub)
    _add_audit(sub, defaults)
    add_submit_parser(sub)
    _add_client_verbs(sub)
    add_models_parser(sub)
    add_simulate(sub)
    add_teardown_parser(sub)
    add_jobs_track(add_jobs_parser(sub))
    add_provision_parser(sub)
    add_broker_parser(sub)
    add_workers_parser(sub)
    add_sites_parser(sub)
    add_ledger_parser(sub)
    add_backup_parser(sub)
    token = sub.add_parser("token", help="make a bearer token and its token-table entry")
    token.add_argument("identity", help="who holds it: a worker's id, 'coordinator', a person")
    token.add_argument("--role", required=True, choices=["coordinator", "worker", "submitter", "viewer"])
    token.set_defaults(run=cmd_token)
    listing.finish(parser, sub)  # last: it lists every verb registered above
    return parser


def _add_demo(sub: Subcommands, d: DemoOptions) -> None:
    from fedbroker.app.tracking import add_track_arguments

    demo = sub.add_parser("demo", help="run a whole private federation on this machine")
    demo.add_argument("--workers", type=int, default=d.workers)
    demo.add_argument("--rounds", type=int, default=d.rounds)
    demo.add_argument("--mode", choices=["sync", "async"], default=d.mode,
                      help="synchronous rounds, or asynchronous FedBuff (its table shows versions)")
    demo.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet α of the non-IID split")
    demo.add_argument("--partition", choices=["iid", "dirichlet", "classes"], default=d.partition)
    demo.add_argument("--dp", action=argparse.BooleanOptionalAction, default=d.dp, help="train with Opacus DP")
    demo.add_argument("--dataset", choices=["digits", "breast_cancer", "wine", "iris"], default=d.dataset)
    demo.add_argument("--broker", default="", help="amqp://user:pass@host:5672/ (default: in-process bus)")
    demo.add_argument("--out", default=d.out)
    demo.add_argument("--seed", type=int, default=d.seed)
    demo.add_argument("--local-epochs", type=int, default=d.local_epochs)
    demo.add_argument("--lr", type=float, default=d.lr)
    demo.add_argument("--noise-multiplier", type=float, default=d.noise_multiplier)
    demo.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    demo.add_argument("--epsilon-budget", type=float, default=d.epsilon_budget)
    add_track_arguments(demo, what="the demo's job")
    demo.set_defaults(run=cmd_demo)


def _add_services(sub: Subcommands) -> None:
    """The three long-running processes, each configured by a YAML file and FEDBROKER__ variables."""
    for name, fn, help_text in (("aggregator", cmd_aggregator, "run the gRPC aggregation service"),
                                ("coordinator", cmd_coordinator, "run the coordinator"),
                                ("worker", cmd_worker, "run one data owner's worker")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", help="YAML config file (FEDBROKER__SECTION__KEY variables override it)")
        p.set_defaults(run=fn)
        if name == "aggregator":
            p.add_argument("--listen")
        if name == "coordinator":
            p.add_argument("--broker")
            p.add_argument("--listen")
            p.add_argument("--aggregator", help="host:port of the aggregation service")
            p.add_argument("--state-dir")
        if name == "worker":
            p.add_argument("--broker")
            p.add_argument("--id")


def _add_audit(sub: Subcommands, d: DemoOptions) -> None:
    audit = sub.add_parser("audit", help="membership-inference attack on the same federation with and without DP")
    audit.add_argument("--workers", type=int, default=3)
    audit.add_argument("--rounds", type=int, default=5)
    audit.add_argument("--local-epochs", type=int, default=10, help="long local training, so a non-private model overfits")
    audit.add_argument("--hidden", type=int, default=256)
    audit.add_argument("--lr", type=float, default=d.lr)
    audit.add_argument("--partition", choices=["iid", "dirichlet", "classes"], default="iid")
    audit.add_argument("--dataset", choices=["digits", "breast_cancer", "wine", "iris"], default="digits")
    audit.add_argument("--noise-multiplier", type=float, default=d.noise_multiplier)
    audit.add_argument("--epsilon-budget", type=float, default=1000.0, help="high, so the DP run is not cut short")
    audit.add_argument("--broker", default="")
    audit.add_argument("--out", default="runs")
    audit.set_defaults(run=cmd_audit)


def _add_client_verbs(sub: Subcommands) -> None:
    """`status`: a data scientist's look at the coordinator (`submit` is fedbroker.app.submit)."""
    status = sub.add_parser("status", help="jobs, rounds and workers in a table")
    status.add_argument("--coordinator", help="host:port, or several comma-separated (a standby is passed over; default: coordinator.targets, else coordinator.target, 127.0.0.1:50052)")
    status.add_argument("--config", help="YAML config with the client section (token, CA) and coordinator.target")
    status.add_argument("--job")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.set_defaults(run=cmd_status)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one verb; its errors become an exit code and one line on stderr (fedbroker.app.exits)."""
    args = build_parser().parse_args(argv)
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # here, so a reader that went away is met below, not at interpreter exit
        return code
    except BrokenPipeError:  # `fedbroker jobs logs ID | head`: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe stopped
    except BaseException as exc:
        reported = report(exc, args.command, broker_url=getattr(args, "broker", "") or "")
        if reported is None:
            raise
        return reported


if __name__ == "__main__":
    sys.exit(main())
