"""Process configuration: one YAML file, overridden by FEDBROKER__SECTION__KEY environment variables.

Kubernetes mounts the file from a ConfigMap and injects secrets (the broker URL with its password, bearer
tokens) as environment variables or mounted files (the `*_file` settings), so nothing secret has to live
in the file. Secret fields are left out of the objects' repr, so a logged config shows none of them.
Values are validated once, here, into frozen objects; an unknown key or a wrong type is an error naming it.
An environment value for a text setting is taken verbatim (a token or an id such as 007 stays text).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.yamltext import load_yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ENV_PREFIX = "FEDBROKER__"
MAX_CONFIG_BYTES = 1 << 20   # a config file is read (bounded: fedbroker.job.yamltext) only up to this size
_PATH_KEY = re.compile(r"(^|_)(file|dir|path)$")   # a setting that names a file or folder (ca_file, state_dir, ...)
_DATA_PATHS = frozenset({"labels_csv", "masks", "cache"})  # worker.data's other files and folders (image folders)
_D = TypeVar("_D", bound="DataclassInstance")


@dataclass(frozen=True)
class BrokerConfig:
    """Where the control messages travel: RabbitMQ (with its TLS and credentials) or, empty, the in-process bus."""

    url: str = field(default="", repr=False)  # amqp:// or amqps:// (TLS), a cluster's nodes comma-separated
                                               # (bare host:port items reuse the first's user and vhost);
                                               # empty = the in-process bus
    url_file: str = ""                 # or read the URL (with its password) from this mounted secret file
    ca_file: str = ""                  # amqps://: verify the broker against this CA (default: system CAs)
    cert_file: str = ""                # amqps:// with a client certificate (RabbitMQ's EXTERNAL/mTLS)
    key_file: str = ""
    namespace: str = "fedbroker"
    max_attempts: int = 5
    heartbeat_s: int = 30
    consumer_timeout_s: float = 1800.0  # the consumer timeout of task deliveries: set on every task queue and
                                        # consumer (x-consumer-timeout, applied by RabbitMQ 3.12+; older ones apply
                                        # their own consumer_timeout, which this must then equal), and the
                                        # coordinator refuses jobs whose round_timeout_s would outlast it;
                                        # 0 = do not set it, do not check
    queue_type: str = "classic"         # classic | quorum: quorum queues replicate the task, control and dead
                                        # queues on every node of a RabbitMQ cluster (deploy/RELIABILITY.md);
                                        # url then lists the nodes, comma-separated

    def __post_init__(self) -> None:
        if self.queue_type not in ("classic", "quorum"):
            raise ConfigError("queue_type", f"must be classic or quorum, got {self.queue_type!r}")


@dataclass(frozen=True)
class ServerTLSSection:
    """A gRPC port's TLS: its certificate and key, and a client CA that turns on mutual TLS."""

    cert_file: str = ""                # PEM chain; with key_file, the gRPC port speaks TLS
    key_file: str = ""
    client_ca_file: str = ""           # set = mutual TLS: clients need a certificate signed by this CA


@dataclass(frozen=True)
class ClientSection:
    """How this process calls the gRPC services (a worker or the coordinator → aggregator, the CLI →
    coordinator): its bearer token and TLS."""

    token: str = field(default="", repr=False)  # prefer token_file (a mounted Secret)
    token_file: str = ""
    ca_file: str = ""                  # set = TLS: verify the server against this CA
    cert_file: str = ""                # mTLS: this process's certificate and key
    key_file: str = ""
    server_name: str = ""              # the name to check in the server certificate, if not the target host


@dataclass(frozen=True)
class AggregatorConfig:
    """The aggregation service: where it listens, how others reach it, and the limits it enforces."""

    listen: str = "0.0.0.0:50051"
    target: str = "127.0.0.1:50051"   # how the coordinator and workers reach it
    max_update_bytes: int = 1 << 30
    selection_time_limit_s: float = 30.0
    alignment_time_limit_s: float = 120.0  # then a close falls back to the weighted mean (aggregators/combine.py)
    # the gRPC thread budget (fedbroker.rpc.callguard, deploy/SECURITY.md): no caller can take every thread
    threads: int = 48                  # the server's thread pool (idle threads cost nothing)
    health_threads: int = 2            # kept for health checks: every other call together holds the rest
    max_streams: int = 32              # workers' uploads and downloads at once (the coordinator's are exempt)
    max_streams_per_worker: int = 2    # one worker identity's uploads and downloads at once
    stream_idle_timeout_s: float = 60.0  # a stream that waits this long on its client is ended, freeing its thread
    # workers' heartbeats at the service (WorkerPresence.KeepAlive, aggregators/presence.py): each told when to
    # come back, jittered around this interval and paced to at most this many beats in any one second
    heartbeat_interval_s: float = 30.0
    heartbeat_max_per_s: int = 500
    spool_dir: str = ""                # accepted updates and global models on disk before they are acknowledged,
                                       # reloaded on restart (deploy/RELIABILITY.md); empty = memory only
    spool_lock_wait_s: float = 30.0    # a restart waits this long for the old process to let go of the spool
    metrics_port: int = 0              # Prometheus /metrics on this port; 0 = no exporter
    metrics_addr: str = "0.0.0.0"     # the exporter's bind address: 0.0.0.0 for a container scraped from
                                       # outside; 127.0.0.1 on a shared host (no /metrics for the network)
    tokens_file: str = ""              # the token table (fedbroker.rpc.auth); empty = authentication off
    tls: ServerTLSSection = field(default_factory=ServerTLSSection)
    # replicas (deploy/OPERATING.md "Aggregation replicas"): each job owned by one through a lease in this database
    # (the coordinator's), its state on a spool_dir every replica mounts; empty = one service, no leases
    database_url: str = ""
    database_url_file: str = ""        # or read it (with its password) from this mounted secret file
    advertise: str = ""                # this replica's address as `targets` lists it (a not_owner refusal names it)
    lease_ttl_s: float = 6.0           # a dead owner's jobs move to another replica this long after it stopped
    targets: tuple[str, ...] = ()      # every replica, for the coordinator and the workers; empty = `target`

    def target_list(self) -> str:
        """How the coordinator and workers reach the service: every replica, comma-separated, else `target`."""
        return ",".join(self.targets) if self.targets else self.target


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator: where it listens, where it keeps its durable state, and how it paces rounds."""

    listen: str = "0.0.0.0:50052"
    target: str = "127.0.0.1:50052"
    state_dir: str = "state"           # one coordinator's (locked while it runs; created 0700): its checkpoints,
                                       # and its state too unless database_url is set
    # the state in PostgreSQL instead of an embedded SQLite file (clusters, a standby coordinator):
    # postgresql+psycopg://user@host:5432/db (deploy/OPERATING.md); empty = coordinator.sqlite in state_dir
    database_url: str = field(default="", repr=False)
    database_url_file: str = ""        # or read the URL (with its password) from this mounted secret file
    heartbeat_timeout_s: float = 60.0
    max_running_jobs: int = 16         # jobs driven at once (a thread each); more wait `pending`, in order
    safety_poll_s: float = 2.0         # rounds wait on the aggregation service's events; a status look at least this often
    metrics_port: int = 0              # Prometheus /metrics on this port; 0 = no exporter
    metrics_addr: str = "0.0.0.0"     # the exporter's bind address: 0.0.0.0 for a container scraped from
                                       # outside; 127.0.0.1 on a shared host (no /metrics for the network)
    tokens_file: str = ""              # who may SubmitJob/Status (fedbroker.rpc.auth); empty = authentication off
    tls: ServerTLSSection = field(default_factory=ServerTLSSection)
    # broker user → the worker ids it may speak for on the control queue (deploy/SECURITY.md): a registration,
    # heartbeat or outcome is refused unless its broker-validated user_id is mapped to its worker id. Empty =
    # not checked (any broker user may speak for any worker; logged at start). `fedbroker provision` writes it.
    worker_broker_users: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a job whose category no registered worker serves: refused at submission (true), or accepted with a
    # warning naming the known categories (false: a worker of it may register later)
    strict_categories: bool = False
    # the standby coordinator (coordinator/standby.py; needs a shared database): the lease `coordinator` lapses this
    # long after its leader last renewed it (renewed every third of it), and the standby takes over within a third
    # of it more: a leader's death is taken over in 2/3 to 4/3 of it (5-10 s); a leader that cannot reach the
    # database for this long stops (exit 75)
    lease_ttl_s: float = 7.5
    # every coordinator a client may reach, tried in order (a standby answers UNAVAILABLE `standby` and the next is
    # asked); empty = `target` alone. `--coordinator a,b` on the command line likewise.
    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _raise_all(self.problems())

    def problems(self) -> list[ConfigError]:
        """Every bad value of the section at once (load_config has checked their types)."""
        checks = (("max_running_jobs", self.max_running_jobs, self.max_running_jobs >= 1, "an integer >= 1"),
                  ("heartbeat_timeout_s", self.heartbeat_timeout_s, self.heartbeat_timeout_s > 0, "seconds > 0"),
                  ("safety_poll_s", self.safety_poll_s, 0 < self.safety_poll_s <= 3600, "seconds in (0, 3600]"),
                  ("metrics_port", self.metrics_port, 0 <= self.metrics_port <= 65535, "a port in [0, 65535]"),
                  ("lease_ttl_s", self.lease_ttl_s, 0 < self.lease_ttl_s <= 3600, "seconds in (0, 3600]"),
                  ("targets", self.targets, all(_is_target(t) for t in self.targets),
                   "host:port addresses, none empty"))
        found = [ConfigError(f"coordinator.{name}", f"must be {rule}, got {value!r}")
                 for name, value, ok, rule in checks if not ok]
        if self.database_url and self.database_url_file:
            found.append(ConfigError("coordinator.database_url", "set either coordinator.database_url or "
                                                                 "coordinator.database_url_file, not both"))
        if self.database_url and not self.database_url.startswith(("postgresql://", "postgresql+psycopg://",
                                                                   "sqlite:///")):
            found.append(ConfigError("coordinator.database_url", "must be a postgresql+psycopg:// (or sqlite:///) "
                                                                 "URL (the value is not shown: it may hold a password)"))
        return found


def _is_target(target: str) -> bool:
    host, _, port = target.strip().rpartition(":")
    return bool(host) and port.isdigit()


@dataclass(frozen=True)
class PartitionSection:
    """Which slice of a bundled set this worker holds: how demos and experiments simulate several owners."""

    scheme: str = "iid"
    num_clients: int = 1
    client_index: int = 0
    alpha: float = 0.5
    classes_per_client: int = 2
    seed: int = 0


@dataclass(frozen=True)
class LimitsSection:
    """The site's own ceilings on the models it trains, per sample, read from the model's spec alone
    (fedbroker.graph.shapes.Bounds): a task whose model is over any of them is refused with the figures
    before the model is built or any ε is spent. 0 = no ceiling."""

    max_parameters: int = 0
    max_activation_bytes: int = 0      # float32 bytes of the input and of every node's output, one sample
    max_flops: int = 0                 # one sample's forward pass

    def __post_init__(self) -> None:
        for name in ("max_parameters", "max_activation_bytes", "max_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"worker.limits.{name}", f"must be an integer >= 0 (0: no ceiling), got {value!r}")


@dataclass(frozen=True)
class DPPolicy:
    """The data owner's privacy policy, the worker's `dp` section; nothing in a job can override it.

    Enabled, the worker trains with DP-SGD at this noise and clipping, and refuses a task whose projected
    ε for its job (with the other jobs' ε on its ledger) would exceed `epsilon_budget` at this `delta`.
    A disabled policy's numbers are not used, so they are not checked either.
    """

    enabled: bool = True
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    epsilon_budget: float = 10.0
    # In a job with privacy.distributed: `local` adds the job's whole noise dose to this site's share (it relies on
    # no other site); `distributed` adds only its share (z/√quorum), at least enough that its own share alone
    # leaves ε ≤ local_floor_epsilon (0: no floor). Jobs without privacy.distributed train as before either way.
    mode: str = "local"
    local_floor_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _raise_all(self.problems() if self.enabled else [])

    def problems(self) -> list[ConfigError]:
        """Every bad value of the policy at once, so an owner fixes the file in one pass."""
        out = [ConfigError(f"dp.{name}", f"must be a number > 0, got {value!r}")
               for name, value in (("noise_multiplier", self.noise_multiplier), ("max_grad_norm", self.max_grad_norm))
               if not _is_number(value) or not value > 0]
        if not _is_number(self.delta) or not 0.0 < self.delta < 1.0:
            out.append(ConfigError("dp.delta", f"must lie strictly between 0 and 1, got {self.delta!r}"))
        if not _is_number(self.epsilon_budget) or not self.epsilon_budget > 0:
            out.append(ConfigError("dp.epsilon_budget", f"must be > 0, got {self.epsilon_budget!r}"))
        if self.mode not in DP_MODES:
            out.append(ConfigError("dp.mode", f"must be 'local' or 'distributed', got {self.mode!r}"))
        if not _is_number(self.local_floor_epsilon) or not 0 <= self.local_floor_epsilon < math.inf:
            out.append(ConfigError("dp.local_floor_epsilon", f"must be a number >= 0 (0: no floor), "
                                                             f"got {self.local_floor_epsilon!r}"))
        return out


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


DP_MODES = ("local", "distributed")
STANDARDIZE_MODES = ("none", "site", "federated")
LABEL_KINDS = ("class", "multilabel", "target", "mask")   # worker.data.labels: what a sample's label is


def _raise_all(problems: list[ConfigError]) -> None:
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


@dataclass(frozen=True)
class DataSection:
    """A data owner's own file (`worker.dataset` csv, npz or parquet), read on the worker and never sent.

    Labels are class indices 0..K-1, or any values listed in `classes` (in class order, so every owner of a
    category numbers the classes alike).

    `standardize` (STANDARDIZE_MODES; YAML true means `site`, false `none`, as before the modes existed):
    `site` z-scores each feature with this worker's own mean and std at load (sites with different scales
    then train one model on inputs normalised differently, and the model's download cannot say how);
    `federated` keeps the data raw and trains only models whose first layer standardises their input with
    statistics the sites agreed on (shared once, noised: `worker.statistics_epsilon`), so the preprocessing
    travels with the model; `none` keeps the data raw and takes any model.
    """

    path: str = ""
    label_column: str = "label"        # csv, parquet: the column of class labels
    feature_columns: tuple[str, ...] = ()  # csv, parquet: the feature columns in order; empty = all but the label
    features_key: str = "x"            # npz: the samples, shape (N, ...)
    labels_key: str = "y"              # npz: the labels, shape (N,)
    classes: tuple[str, ...] = ()      # the label values in class order; empty = the labels are 0..K-1 already
    num_classes: int = 0               # the category's number of classes; 0 = the largest label + 1
    standardize: str | bool = "none"   # none | site | federated (class docstring); true = site, false = none
    # What a label is (the job's task needs its kind: fedbroker.datasets.labels): a class index (classification),
    # a multi-hot row of 0/1 (multilabel: csv/parquet `label_columns`, npz y (N, L)), real targets (regression:
    # `label_column` or `label_columns`, npz y (N,) or (N, k)), or a mask of class indices per pixel
    # (segmentation: npz y (N, H, W) matching x's spatial size).
    labels: str = "class"
    label_columns: tuple[str, ...] = ()  # csv, parquet: several label columns (multilabel, several targets)
    # Files on the site's disk (worker.dataset images | nifti | dicom; fedbroker.datasets.images, .volumes): `path` is
    # the folder of images or volumes, read a batch at a time (fedbroker.datasets.stream), never all at once.
    labels_csv: str = ""               # images: a CSV naming each file (`file_column`) and its label column(s)
    file_column: str = "file"          # images: the labels CSV's column of file names, relative to `path`
    masks: str = ""                    # images, nifti, dicom: the folder of masks, paired with the images by file name
    slices: str = ""                   # nifti, dicom: "" trains on whole volumes; axial | coronal | sagittal on slices
    cache: str = ""                    # a folder to keep decoded samples in (the owner's switch); "" = decode each time
    memory_mib: int = 2048             # the most memory the decoded samples may take at once (batches and cache)

    def __post_init__(self) -> None:
        if self.labels not in LABEL_KINDS:
            raise ConfigError("worker.data.labels", f"must be {' or '.join(map(repr, LABEL_KINDS))}, got "
                                                    f"{self.labels!r}")
        mode = self.standardize
        if isinstance(mode, bool):
            mode = "site" if mode else "none"
        if mode not in STANDARDIZE_MODES:
            raise ConfigError("worker.data.standardize", f"must be {' or '.join(map(repr, STANDARDIZE_MODES))} (true "
                                                         f"= 'site', false = 'none'), got {self.standardize!r}")
        object.__setattr__(self, "standardize", mode)


@dataclass(frozen=True)
class WorkerConfig:
    """A worker process: who it is, the data it holds, and the owner's privacy policy for them."""

    id: str = "worker-0"
    categories: tuple[str, ...] = ("digits",)
    dataset: str = "digits"
    idx_dir: str = ""                  # the folder of the IDX files mnist/fashion_mnist/idx need; "" = none
    data: DataSection = field(default_factory=DataSection)  # dataset csv | npz | parquet (and idx's num_classes)
    test_fraction: float = 0.2
    split_seed: int = 0
    partition: PartitionSection = field(default_factory=PartitionSection)
    dp: DPPolicy = field(default_factory=DPPolicy)
    limits: LimitsSection = field(default_factory=LimitsSection)  # the models this site will train (refused over)
    ledger_path: str = "ledger.json"
    device: str = "auto"
    torch_threads: int = 0             # torch intra-op threads for training; 0 = torch's default (one per core)
    physical_batch_size: int = 0       # DP: most samples per forward/backward pass, a larger Poisson batch runs
                                       # as virtual steps (same update, same ε); 0 = the whole batch in one pass
    heartbeat_s: float = 10.0
    # beat WorkerPresence.KeepAlive at the aggregation service (aggregator.targets, the address this site uploads
    # to), when the service says (worker/presence.py): its operator counts the workers present
    presence: bool = True
    coordinator_broker_user: str = ""  # the broker user whose tasks this worker trains (RabbitMQ validates a
                                       # message's user_id); others are dead-lettered. "" = any (logged at start)
    # The ε of the two releases a job may ask of a site before round 1 (worker/sharing.py), each drawn once per
    # data set, kept in the ledger and charged to it once. 0 = exact, by the owner's explicit choice.
    # histogram_epsilon: Laplace noise of scale 1/ε on each count (one record added or removed changes one count
    # by 1). At ε 1 a count is off by 1 on average (|Laplace(1)|; ~1.4 root mean square): a class of ~100 still
    # reads within ~1-2 %, enough for class shares (PFNM/NAFI) and DWFed's ISH, while no exact count leaves.
    histogram_epsilon: float = 1.0
    # statistics_epsilon: the Gaussian mechanism on per-feature sums and sums of squares (data.standardize:
    # federated), at this ε and the δ of the site's DP policy (1e-5 when its DP is off). 0 or at least 0.1: a
    # coordinator excludes statistics noised more widely (fedbroker/statistics_release.py).
    statistics_epsilon: float = 1.0
    evaluation: str = "allow"          # allow | deny: score jobs' global models on this site's held-out split
    metrics_port: int = 0              # Prometheus /metrics on this port; 0 = no exporter
    metrics_addr: str = "0.0.0.0"     # the exporter's bind address: 0.0.0.0 for a container scraped from
                                       # outside; 127.0.0.1 on a shared host (no /metrics for the network)
    # send this worker's own WARNING+ log lines (level, logger, text cut short, time: never data) to the
    # coordinator, rate-limited, for the operator's `fedbroker sites logs` (worker/log_forward.py)
    forward_logs: bool = True


@dataclass(frozen=True)
class Config:
    """One process's settings, built once from YAML and the environment and validated at the edge."""

    broker: BrokerConfig = field(default_factory=BrokerConfig)
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    client: ClientSection = field(default_factory=ClientSection)
    log_level: str = "INFO"


def load_config(path: str | None = None, *, environ: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> Config:
    """File (optional) < environment < explicit overrides (command-line flags)."""
    raw: dict[str, Any] = {}
    if path:
        with open(path, "rb") as fh:
            text = fh.read(MAX_CONFIG_BYTES + 1)
        loaded = load_yaml(text, where=path, max_bytes=MAX_CONFIG_BYTES) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(path, "the config file must hold a mapping")
        raw = _paths_from(loaded, os.path.dirname(os.path.abspath(path)))
    for key, value in sorted((environ if environ is not None else os.environ).items()):
        if key.startswith(ENV_PREFIX):
            parts = [p.lower() for p in key[len(ENV_PREFIX):].split("__")]
            _set(raw, parts, _EnvValue(value))
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set(raw, dotted.split("."), value)
    errors: list[ConfigError] = []
    config = _build(Config, raw, "", errors)
    _raise_all(errors)
    return config


PLACEHOLDER = "FILL-IN"
"""What a kit writes where a site's data goes until its owner names it: the worker refuses to start on it."""


def _paths_from(tree: dict[str, Any], folder: str) -> dict[str, Any]:
    """The file's own relative paths (every `*_file`, `*_dir`, `*_path` and `path` setting, and worker.data's
    `labels_csv`, `masks` and `cache`) made absolute from its folder: a file means the same files from whichever
    folder a process or a viewer starts (from the current folder, `--config kit/viewer.yaml` read another
    identity's `secrets/token`). Variables and flags stay relative to the current folder."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            value = _paths_from(value, folder)
        elif isinstance(key, str) and (_PATH_KEY.search(key) or key in _DATA_PATHS) and isinstance(value, str) \
                and value and value != PLACEHOLDER:  # a kit's data left to fill in is no path (fedbroker.app.unfilled)
            value = os.path.join(folder, value)
        out[key] = value
    return out


def _set(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        tree = tree.setdefault(part, {})
        if not isinstance(tree, dict):
            raise ConfigError(".".join(parts), "overrides a value that is not a section")
    tree[parts[-1]] = value


class _EnvValue(str):
    """An environment variable's text: verbatim for a text setting, read as YAML for any other."""

    def parsed(self, where: str) -> Any:
        return load_yaml(str(self), where=where, max_bytes=MAX_CONFIG_BYTES) if self.strip() else ""


def _build(cls: type[_D], raw: Any, where: str, errors: list[ConfigError]) -> _D:
    """`raw` as a `cls`, every problem added to `errors` under its full path (an unknown key, a wrong type, a value
    the section's own checks refuse), so a file is fixed in one pass; the defaults stand in for what is wrong."""
    try:
        if isinstance(raw, _EnvValue):
            raw = raw.parsed(where or "config")
        if not isinstance(raw, Mapping):
            raise ConfigError(where or "config", f"must be a mapping, got {type(raw).__name__}")
    except ConfigError as exc:
        errors.append(exc)
        return cls()
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        at = f"{where}.{key}" if where else key
        try:
            if key not in names:
                raise ConfigError(at, f"unknown setting; known: {', '.join(sorted(names))}")
            kwargs[key] = _coerce(hints[key], value, at, errors)
        except ConfigError as exc:
            errors.extend(getattr(exc, "errors", [exc]))
    try:
        return cls(**kwargs)
    except ConfigError as exc:  # the section's own checks name fields from the key its parent holds it under
        errors.extend(_under(where, e) for e in getattr(exc, "errors", [exc]))
        return cls()


def _under(where: str, error: ConfigError) -> ConfigError:
    """`error` (a section's own, `dp.delta`) named by its full path (`worker.dp.delta`)."""
    parent, _, own = where.rpartition(".")
    if error.field != own and not error.field.startswith(own + "."):
        parent = where
    return ConfigError(f"{parent}.{error.field}" if parent else error.field, error.problem)


def _coerce(hint: Any, value: Any, at: str, errors: list[ConfigError]) -> Any:
    if isinstance(value, _EnvValue):
        value = str(value) if hint is str else value.parsed(at)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, at, errors)
    origin = typing.get_origin(hint)
    if origin is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and k for k in value):
            raise ConfigError(at, f"must be a mapping with text keys, got {type(value).__name__} {value!r}")
        _, value_hint = typing.get_args(hint)
        return {k: _coerce(value_hint, v, f"{at}.{k}", errors) for k, v in value.items()}
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise ConfigError(at, f"must be a list of strings, got {value!r}")
        return tuple(i.strip() for i in items if i.strip())
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) > 1 and any(isinstance(value, a) for a in options):  # str | bool: either, as written
            return value
        hint = options[0]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, str):  # YAML 1.1 reads "1e-05" as a string
        try:
            return hint(value)
        except ValueError:
            raise ConfigError(at, f"must be {hint.__name__}, got {value!r}") from None
    if hint is str and value is None:
        return ""
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(at, f"must be {hint.__name__}, got {type(value).__name__} {value!r}")
    return value
