"""Build each process's components from a Config: shared by the CLI and the demo, so both run the same code.

Secrets (the broker URL, bearer tokens, TLS keys) are read here from the config's values or mounted files,
and never logged: the bus URL is logged masked, tokens not at all.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedbroker.app.glibc_malloc import keep_freed_memory
from fedbroker.bus import Bus, InProcessBus, mask_url, open_bus
from fedbroker.config import Config
from fedbroker.errors import ConfigError
from fedbroker.metrics import start_exporter
from fedbroker.rpc.aio_server import AioServer
from fedbroker.rpc.auth import ClientSecurity, ServerTLS, read_secret
from fedbroker.rpc.callguard import CallLimits
from fedbroker.rpc.live_auth import Followed, follow_table

if TYPE_CHECKING:
    from fedbroker.aggregators.ownership import JobOwnership
    from fedbroker.app.leading import Election
    from fedbroker.coordinator.scheduler import Coordinator
    from fedbroker.worker.agent import WorkerAgent
    from fedbroker.worker.secure_task import SecureSteps

log = logging.getLogger(__name__)


def broker_url(config: Config) -> str:
    """The broker URL from broker.url or broker.url_file (a kit's secrets/broker-url); empty: in-process."""
    return read_secret(config.broker.url, config.broker.url_file, field="broker.url")


def make_bus(config: Config) -> Bus:
    """The process's bus: RabbitMQ at the configured URL, or the in-process bus when there is none."""
    b = config.broker
    url = broker_url(config)
    log.info("bus: %s (namespace %s)", mask_url(url) if url else "in-process", b.namespace)
    if not url:
        return open_bus(None, namespace=b.namespace, max_attempts=b.max_attempts)
    return open_bus(url, namespace=b.namespace, max_attempts=b.max_attempts, heartbeat_s=b.heartbeat_s,
                    ca_file=b.ca_file, cert_file=b.cert_file, key_file=b.key_file,
                    consumer_timeout_s=b.consumer_timeout_s or None, queue_type=b.queue_type)


def client_security(config: Config, *, expected_target: str = "") -> ClientSecurity:
    """This process's credentials for calling a gRPC service (`client` section)."""
    return ClientSecurity.from_config(config.client, expected_target=expected_target)


def start_aggregator(config: Config) -> tuple[AioServer, int]:
    """The aggregation service serving on aggregator.listen; the server and the port it bound."""
    from fedbroker.aggregators.presence import HeartbeatPacing
    from fedbroker.aggregators.round_book import RoundBook
    from fedbroker.aggregators.service import SERVICE_NAME, serve

    keep_freed_memory()  # every upload streams a model through the heap
    a = config.aggregator
    tokens = follow_table(a.tokens_file, service=SERVICE_NAME)
    tls = ServerTLS.from_files(a.tls.cert_file, a.tls.key_file, a.tls.client_ca_file, where="aggregator.tls")
    book = RoundBook(max_update_bytes=a.max_update_bytes, selection_time_limit_s=a.selection_time_limit_s,
                     alignment_time_limit_s=a.alignment_time_limit_s, spool_dir=a.spool_dir or None,
                     spool_lock_wait_s=a.spool_lock_wait_s, ownership=job_ownership(config))
    if book.table.ownership is not None:  # a clean exit hands each job on at once, not after lease_ttl_s
        atexit.register(book.stop)
    _export("aggregator", a.metrics_port, a.metrics_addr)
    limits = CallLimits(threads=a.threads, health_threads=a.health_threads, max_streams=a.max_streams,
                        max_streams_per_worker=a.max_streams_per_worker,
                        stream_idle_timeout_s=a.stream_idle_timeout_s)
    heartbeat = HeartbeatPacing(interval_s=a.heartbeat_interval_s, max_per_s=a.heartbeat_max_per_s,
                                early_slack_s=min(1.0, a.heartbeat_interval_s / 10))
    return serve(book, address=a.listen, limits=limits, tokens=tokens, tls=tls, heartbeat=heartbeat)


def job_ownership(config: Config) -> JobOwnership | None:
    """Aggregation replicas: this one's leases on jobs, in the database aggregator.database_url names; None for
    a single service (no database named)."""
    from fedbroker.aggregators.ownership import JobOwnership, lease_engine

    a = config.aggregator
    url = read_secret(a.database_url, a.database_url_file, field="aggregator.database_url")
    if not url:
        return None
    if not a.advertise:
        raise ConfigError("aggregator.advertise", "replicas (aggregator.database_url) must each advertise the address "
                                                  "clients reach them at, as aggregator.targets lists it")
    return JobOwnership(lease_engine(url), advertise=a.advertise, ttl_s=a.lease_ttl_s)


def _export(role: str, port: int, addr: str) -> None:
    """The Prometheus exporter of this process (once per address and port, shared by the demo's in-process
    parts), bound to the role's `metrics_addr`."""
    if port < 0 or port > 65535:
        raise ConfigError(f"{role}.metrics_port", f"must be between 0 (off) and 65535, got {port}")
    if start_exporter(port, addr=addr):
        log.info("%s metrics on http://%s:%d/metrics", role, addr, port)


@dataclass
class CoordinatorProcess:
    """A running coordinator with its gRPC server and bus, stopped together."""

    coordinator: Coordinator
    server: AioServer
    port: int
    bus: Bus
    election: Election | None = None   # on a shared database: it acts only while it leads (app/leading.py)

    def stop(self) -> None:
        """Stop scheduling, then serving, then the bus, and release the state directory; a leader then gives its
        lease up, so the standby takes over at once."""
        acted = self.election.stop() if self.election is not None else True
        if acted:
            self.coordinator.stop()
        self.server.stop(grace=1)
        self.bus.close()
        if self.election is not None and acted:
            self.election.leadership.release()
        self.coordinator.store.close()  # releases the state directory's lock


def start_coordinator(config: Config, *, bus: Bus | None = None, config_file: str | None = None,
                      overrides: Mapping[str, Any] | None = None) -> CoordinatorProcess:
    """The coordinator scheduling and serving on coordinator.listen, its state in coordinator.state_dir.
    `config_file` (with the `overrides` it was loaded with): the file `config` came from, whose
    coordinator.worker_broker_users it follows while it runs (`broker_users_of`)."""
    from fedbroker.coordinator.evaluation import evaluate_global
    from fedbroker.coordinator.scheduler import Coordinator
    from fedbroker.coordinator.service import SERVICE_NAME, serve
    from fedbroker.coordinator.store import StateStore
    from fedbroker.rpc.aggregation_client import AggregatorClient

    c = config.coordinator
    tokens = follow_table(c.tokens_file, service=SERVICE_NAME)
    tls = ServerTLS.from_files(c.tls.cert_file, c.tls.key_file, c.tls.client_ca_file, where="coordinator.tls")
    security = client_security(config, expected_target=config.aggregator.target_list())
    aggregators = config.aggregator.target_list()  # every replica, comma-separated (fedbroker.rpc.replicas)
    _export("coordinator", c.metrics_port, c.metrics_addr)
    database_url = read_secret(c.database_url, c.database_url_file, field="coordinator.database_url")
    # embedded: refused while another coordinator holds state_dir; a shared database: state_dir keeps only the
    # checkpoints, which the two coordinators share (a ReadWriteMany volume), and they elect a leader (app/leading.py)
    store = StateStore.for_coordinator(c.state_dir, database_url)
    leadership = None
    if database_url:
        from fedbroker.app.leading import advertised
        from fedbroker.coordinator.standby import Leadership

        leadership = Leadership(store.engine, ttl_s=c.lease_ttl_s, advertise=advertised(c.listen))
        store.fence = leadership.fence  # before any write: each is checked against the lease's term
    bus = bus or make_bus(config)
    coordinator = Coordinator(
        bus=bus, store=store,
        aggregator=AggregatorClient(aggregators, security=security), aggregator_target=aggregators,
        checkpoint_dir=os.path.join(c.state_dir, "checkpoints"), heartbeat_timeout_s=c.heartbeat_timeout_s,
        evaluator=evaluate_global,
        broker_consumer_timeout_s=None if isinstance(bus, InProcessBus) else config.broker.consumer_timeout_s or None,
        max_running_jobs=c.max_running_jobs, safety_poll_s=c.safety_poll_s,
        worker_broker_users=c.worker_broker_users, strict_categories=c.strict_categories,
        follow_broker_users=broker_users_of(config_file, overrides) if config_file else None,
    )

    def act() -> None:
        coordinator.start()
        bus.start()
        coordinator.log_consumer_timeout()

    if leadership is None:
        act()
    election = None
    if leadership is not None:
        from fedbroker.app.leading import Election

        election = Election(leadership, act)
    server, port = serve(coordinator, address=c.listen, tokens=tokens, tls=tls,
                         gate=election.gate if election is not None else None)
    if election is not None:
        election.start(port)  # a standby until it leads, then `act`
    else:
        log.info("coordinator listening on port %d", port)
    return CoordinatorProcess(coordinator, server, port, bus, election)


def broker_users_of(config_file: str, overrides: Mapping[str, Any] | None) -> Callable[[], Mapping[str, Any]]:
    """coordinator.worker_broker_users as `config_file` says now (with the environment and `overrides` as at
    start), read again when the file changes: `fedbroker provision add` binds a new site's broker user there,
    and the coordinator accepts its registration without a restart. A changed file that does not load keeps the
    last good map in force, logged and counted as any followed file (live_auth.Followed, kind "senders")."""
    from fedbroker.bus.base import check_name
    from fedbroker.config import load_config

    def load(path: str) -> Mapping[str, Any]:
        try:
            users = load_config(path, overrides=overrides).coordinator.worker_broker_users
        except OSError as exc:
            raise ConfigError(path, f"cannot read it: {exc.strerror}") from None
        for user, worker_ids in users.items():
            for worker_id in worker_ids:
                check_name(f"coordinator.worker_broker_users.{user}", worker_id)
        return users

    return Followed(config_file, load, kind="senders").current


def set_torch_threads(threads: int) -> None:
    """The process's torch intra-op thread count (0: torch's default).

    Small models train fastest on one thread: a second never helped DP training here, and on a loaded
    machine two threads ran 10-100x slower than one (OpenMP threads waiting on each other for whole
    time slices; `make bench`, DP training).
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError("worker.torch_threads", f"must be a whole number >= 0 (0: torch's default), got {threads!r}")
    if threads:
        import torch

        torch.set_num_threads(threads)


def start_worker(config: Config, *, bus: Bus | None = None, secure_steps: SecureSteps | None = None) -> WorkerAgent:
    """A worker consuming its task queue; `bus` is the demo's in-process bus, else the config's broker. A worker
    process of its own (no `bus` given) forwards its warnings to the coordinator unless `worker.forward_logs` is
    off (the demo's workers share a process, and a console, with the coordinator). `secure_steps` watches its
    secure tasks' steps: a test's observer, None in production."""
    from fedbroker.worker.agent import WorkerAgent
    from fedbroker.worker.log_forward import install, remove

    keep_freed_memory()  # every round streams the global model in and the update out
    w = config.worker
    set_torch_threads(w.torch_threads)
    _export("worker", w.metrics_port, w.metrics_addr)
    own_bus = bus is None
    bus = bus or make_bus(config)
    forwarder = install(w.id, bus.publish_control) if own_bus and w.forward_logs else None
    try:
        targets = config.aggregator.target_list()  # where its token may go, and where it beats its presence
        agent = WorkerAgent(w, bus, security=client_security(config, expected_target=targets),
                            log_forwarder=forwarder, secure_steps=secure_steps, aggregator_target=targets)
    except BaseException:
        if forwarder is not None:
            remove(forwarder)
        raise
    agent.start()
    agent.bus.start()
    return agent
