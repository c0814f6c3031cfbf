"""`fedbroker teardown --namespace NS`: remove a local deployment's queues and exchanges from its broker.

What it removes is exactly what the bus declares for that namespace (fedbroker.bus.amqp_topology's
`declared_names`): `NS.coordinator`, `NS.dead`, `NS.worker.<id>` for each worker named (by `--worker`, the
workers registered in the coordinator's `--state-dir`, or with `--config` its coordinator's state_dir and
worker_broker_users), and the exchanges `NS.tasks`, `NS.control`,
`NS.events`, `NS.dlx`. Nothing outside the namespace is touched. A queue that still has a consumer means the
deployment runs: then nothing is removed (unless `--force`). Messages in the removed queues (tasks not yet
trained, dead letters) are lost: the command says how many.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from fedbroker.errors import BusError, ConfigError

NOT_FOUND = 404  # AMQP reply code of a passive declare of a missing queue or exchange


@dataclass(frozen=True)
class Found:
    """One queue or exchange of the namespace as the broker holds it."""

    kind: str        # queue | exchange
    name: str
    messages: int = 0
    consumers: int = 0


def broker_target(args: argparse.Namespace) -> tuple[str, str, Any, list[str]]:
    """(broker URL, namespace, the broker section, the workers the config knows) from --broker/--namespace, else
    the --config file's."""
    from fedbroker.app.launch import broker_url
    from fedbroker.config import load_config

    config = load_config(args.config)  # FEDBROKER__BROKER__* variables count, as for every process
    url = args.broker or broker_url(config)
    if not url:
        raise ConfigError("--broker", "name the broker (amqp://user:pass@host:5672/vhost) or a --config whose "
                                      "broker.url or broker.url_file does")
    # never the default namespace by accident: it is named, or it is the one a deployment's config file names
    namespace = args.namespace or (config.broker.namespace if args.config else "")
    if not namespace:
        raise ConfigError("--namespace", "name the deployment's namespace (broker.namespace), or give its --config")
    return url, namespace, config.broker, config_workers(args, config)


def config_workers(args: argparse.Namespace, config: Any) -> list[str]:
    """The workers a --config file knows: those its coordinator's state_dir registered (unless --state-dir names
    another) and those its worker_broker_users bind (a provisioned server kit's): their queues are the
    deployment's too."""
    if not args.config:
        return []
    ids = [w for bound in config.coordinator.worker_broker_users.values() for w in bound]
    if not args.state_dir and os.path.isdir(config.coordinator.state_dir):
        ids += registered(config.coordinator.state_dir)
    return ids


def registered(state_dir: str) -> list[str]:
    """The workers registered in a (stopped) coordinator's state."""
    from fedbroker.coordinator.store import StateStore

    store = StateStore.in_directory(state_dir)  # refused while a coordinator runs on it
    try:
        return [w.worker_id for w in store.workers()]
    finally:
        store.close()


def worker_ids(args: argparse.Namespace, known: list[str]) -> list[str]:
    """The workers whose queues go: --worker, those registered in the --state-dir, and those `known` (the
    --config's)."""
    ids = list(args.worker or []) + known
    if args.state_dir:
        if not os.path.isdir(args.state_dir):
            raise ConfigError("--state-dir", f"{args.state_dir} is not a folder (the coordinator's state_dir)")
        ids += registered(args.state_dir)
    return sorted(set(ids))


def connect(url: str, section: Any, namespace: str) -> Any:
    """One blocking connection, with the bus's TLS settings; a broker out of reach is one BusError line."""
    import pika

    from fedbroker.bus.amqp_link import LinkSettings, _connection_parameters, tls_context
    from fedbroker.bus.amqp_problem import describe
    from fedbroker.bus.base import check_url
    from fedbroker.retry import Backoff

    settings = LinkSettings(url=check_url(url), client_name=f"{namespace}:teardown", heartbeat_s=30,
                            blocked_timeout_s=30, reconnect=Backoff(initial_s=1, max_s=1),
                            tls=tls_context(url, ca_file=section.ca_file, cert_file=section.cert_file,
                                            key_file=section.key_file))
    params = _connection_parameters("teardown", settings)
    params.socket_timeout = params.stack_timeout = 10
    try:
        return pika.BlockingConnection(params)
    except Exception as exc:  # pika's layers of connect errors: one line naming host, port, reason
        raise BusError(describe(exc, url)) from None


def survey(connection: Any, queues: list[str], exchanges: list[str]) -> list[Found]:
    """What of the namespace exists, by passive declares (a miss closes the channel: a new one is opened)."""
    import pika.exceptions as pex

    found: list[Found] = []
    channel = connection.channel()
    for kind, names in (("queue", queues), ("exchange", exchanges)):
        for name in names:
            try:
                if kind == "queue":
                    ok = channel.queue_declare(name, passive=True).method
                    found.append(Found(kind, name, ok.message_count, ok.consumer_count))
                else:
                    channel.exchange_declare(name, passive=True)
                    found.append(Found(kind, name))
            except pex.ChannelClosedByBroker as exc:
                if exc.reply_code != NOT_FOUND:
                    raise BusError(f"the broker refused to show {kind} {name}: {exc.reply_code} "
                                   f"{exc.reply_text}") from None
                channel = connection.channel()
    channel.close()
    return found


def teardown(url: str, namespace: str, section: Any, workers: list[str], *, force: bool) -> list[Found]:
    """Remove the namespace's queues and exchanges; what was removed. BusError (nothing removed) while a
    queue has consumers, unless `force`."""
    from fedbroker.bus.amqp_topology import declared_names
    from fedbroker.bus.base import Topology, check_name

    for w in workers:
        check_name("--worker", w)
    queues, exchanges = declared_names(Topology(check_name("--namespace", namespace)), workers)
    connection = connect(url, section, namespace)
    try:
        found = survey(connection, queues, exchanges)
        busy = [f for f in found if f.consumers]
        if busy and not force:
            raise BusError("the deployment still runs: " + ", ".join(f"{f.name} has {f.consumers} consumer(s)"
                                                                      for f in busy)
                           + "; stop its coordinator and workers first (or --force); nothing was removed")
        channel = connection.channel()
        for f in found:
            if f.kind == "queue":
                channel.queue_delete(f.name)
            else:
                channel.exchange_delete(f.name)
        channel.close()
    finally:
        connection.close()
    return found


def cmd_teardown(args: argparse.Namespace) -> int:
    """Remove the deployment's queues and exchanges; one line per object removed."""
    from fedbroker.bus import mask_url

    url, namespace, section, known = broker_target(args)
    removed = teardown(url, namespace, section, worker_ids(args, known), force=args.force)
    for f in removed:
        lost = f" ({f.messages} message(s) dropped)" if f.messages else ""
        print(f"removed {f.kind} {f.name}{lost}")
    print(f"namespace {namespace} on {mask_url(url)}: {len(removed)} object(s) removed"
          + ("" if removed else " (nothing of it was there)"))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker teardown` under the main parser's subcommands."""
    p = sub.add_parser("teardown", help="remove a local deployment's queues and exchanges from its broker",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--namespace", help="the deployment's broker.namespace (default: the --config file's)")
    p.add_argument("--broker", help="amqp://user:pass@host:5672/vhost (default: the --config file's broker)")
    p.add_argument("--config", help="a process's YAML config: its broker section (URL, TLS, namespace); the workers its "
                                           "coordinator.state_dir registered and its worker_broker_users bind")
    p.add_argument("--worker", action="append", metavar="ID", help="a worker whose task queue goes too (repeat it)")
    p.add_argument("--state-dir", help="the stopped coordinator's state folder: its registered workers' queues go")
    p.add_argument("--force", action="store_true", help="remove queues that still have consumers")
    p.set_defaults(run=cmd_teardown)
