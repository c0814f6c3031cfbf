"""`fedbroker demo`: a whole private federation on this machine, with progress, a results table and a plot.

The aggregation service always runs as its own process (real gRPC on loopback). With a broker URL the
coordinator and every worker are separate processes too, talking over RabbitMQ; without one they share
this process and the in-process bus (one thread per worker), since an in-process bus cannot span processes.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedbroker.app import tracking
from fedbroker.app.progress import run_tracked
from fedbroker.app.replies import job_status, participant_status, round_status
from fedbroker.errors import ConfigError, ConfigErrors, FedbrokerError
from fedbroker.job.spec import JobSpec, ModelSpec, TrainingConfig, parse_job
from fedbroker.job.status import REFUSED_OR_FAILED, SENT, JobStatus, RoundStatus

if TYPE_CHECKING:
    from fedbroker.app.launch import CoordinatorProcess
    from fedbroker.coordinator.service import CoordinatorClient
    from fedbroker.datasets import Dataset
    from fedbroker.proto import fedbroker_pb2 as pb
    from fedbroker.worker.agent import WorkerAgent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoOptions:
    """The demo's flags, as `fedbroker demo` takes them; `fit_training` adjusts them before a run."""

    workers: int = 3
    rounds: int = 5
    alpha: float = 0.5
    partition: str = "dirichlet"
    dp: bool = True
    dataset: str = "digits"
    broker: str = ""
    out: str = "runs"
    seed: int = 0
    local_epochs: int = 3
    batch_size: int = 32
    lr: float = 0.5
    hidden: int = 64
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    epsilon_budget: float = 10.0
    round_timeout_s: float = 300.0
    mode: str = "sync"   # sync (rounds) | async (FedBuff: `rounds` × workers / buffer updates, as versions)
    track: str | None = None  # MLflow: None = no tracking, "" = MLflow's default store, else its URI
    experiment: str = ""      # the MLflow experiment (default: the job's name)
    run_id: str = field(default_factory=lambda: datetime.now(UTC).strftime("%Y%m%d-%H%M%S"))


# The digits demo's steps per epoch: ~479 samples a worker in batches of 32 (README: ε 7.344/7.617/7.617). A
# smaller set keeps this sampling rate (about 1/15) with a smaller batch, so its ε per epoch stays near digits'.
STEPS_PER_EPOCH = 15
MAX_NOISE_RAISES = 12   # σ is raised in steps of a quarter, at most this many, before the demo gives up


def check_options(options: DemoOptions) -> None:
    """The demo's own options, named as the user typed them, before anything is created."""
    problems: list[ConfigError] = []
    for flag, value, low in (("--workers", options.workers, 1), ("--rounds", options.rounds, 1),
                             ("--local-epochs", options.local_epochs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            problems.append(ConfigError(flag, f"must be a whole number >= {low}, got {value!r}"))
    for flag, number in (("--alpha", options.alpha), ("--lr", options.lr),
                         ("--noise-multiplier", options.noise_multiplier), ("--max-grad-norm", options.max_grad_norm),
                         ("--epsilon-budget", options.epsilon_budget)):
        if not number > 0:
            problems.append(ConfigError(flag, f"must be a number > 0, got {number!r}"))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


def shard_sizes(options: DemoOptions, data: Dataset) -> list[int]:
    """The training samples each demo worker will hold: the split and partition its agent makes."""
    from fedbroker.config import WorkerConfig
    from fedbroker.datasets import train_test_split
    from fedbroker.worker.partition import partition

    defaults = WorkerConfig()
    train, _ = train_test_split(data, test_fraction=defaults.test_fraction, seed=defaults.split_seed)
    shards = partition(train.y, scheme=options.partition, num_clients=options.workers, seed=options.seed,
                       alpha=options.alpha)
    return [len(s) for s in shards]


def planned_epsilon(options: DemoOptions, shards: list[int]) -> float:
    """The largest ε any worker will have spent after all the demo's rounds, by the workers' own accountant."""
    from fedbroker.privacy import dp_sample_rate, planned_steps, project_epsilon

    config = TrainingConfig(rounds=options.rounds, local_epochs=options.local_epochs,
                            batch_size=options.batch_size, lr=options.lr)
    with warnings.catch_warnings():  # Opacus's advice on its α range, for plans far over any budget: not the user's
        warnings.filterwarnings("ignore", message="Optimal order is the smallest alpha")
        return max(project_epsilon([], noise_multiplier=options.noise_multiplier, sample_rate=dp_sample_rate(n, config),
                                   steps=options.rounds * planned_steps(n, config), delta=options.delta)
                   for n in set(shards))


def fit_training(options: DemoOptions, shards: list[int]) -> DemoOptions:
    """Training and DP settings that let every worker afford all the demo's rounds.

    The batch keeps about STEPS_PER_EPOCH steps an epoch on the mean shard (at most `batch_size`, 32); with DP,
    the most local epochs (up to --local-epochs) whose planned ε after --rounds rounds stays within
    --epsilon-budget on every shard; where even one epoch does not fit, σ is raised by quarters. Raises, naming
    the options to change, when nothing fits."""
    batch = max(1, min(options.batch_size, round(sum(shards) / len(shards) / STEPS_PER_EPOCH)))
    fitted = replace(options, batch_size=batch)
    if not options.dp:
        return fitted
    sigma = options.noise_multiplier
    for raises in range(MAX_NOISE_RAISES + 1):
        sigma = options.noise_multiplier + 0.25 * raises
        for epochs in range(options.local_epochs, 0, -1):
            candidate = replace(fitted, local_epochs=epochs, noise_multiplier=sigma)
            if planned_epsilon(candidate, shards) <= options.epsilon_budget:
                return candidate
    raise ConfigError("--rounds", f"{options.rounds} rounds of {options.dataset} cannot fit --epsilon-budget "
                                  f"{options.epsilon_budget:g}: the smallest worker holds {min(shards)} samples, and "
                                  f"even one local epoch a round at σ {sigma:g} spends more; lower --rounds, raise "
                                  f"--epsilon-budget, or split the data more evenly (a larger --alpha, or "
                                  f"--partition iid)")


def demo_job(options: DemoOptions, input_shape: tuple[int, ...], num_classes: int) -> dict[str, Any]:
    """The job the demo submits: a small MLP on the chosen bundled set, every worker in every round."""
    flat = 1
    for d in input_shape:
        flat *= d
    return {
        "name": "demo",
        "category": options.dataset,
        "seed": options.seed,
        "model": {
            "input_shape": list(input_shape),
            "layers": [
                {"type": "Flatten"},
                {"type": "Linear", "in_features": flat, "out_features": options.hidden},
                {"type": "ReLU"},
                {"type": "Linear", "in_features": options.hidden, "out_features": num_classes},
            ],
        },
        "training": {"rounds": demo_versions(options), "local_epochs": options.local_epochs,
                     "batch_size": options.batch_size, "lr": options.lr},
        "aggregation": {"alignment": "none", "weighting": "fedavg", "selection": "all"},
        "schedule": {"min_workers": options.workers, "min_clients": 1, "wait_for_workers_s": 30,
                     "round_timeout_s": options.round_timeout_s, **async_schedule(options)},
        "evaluation": {"dataset": options.dataset},
    }


def async_schedule(options: DemoOptions) -> dict[str, Any]:
    """In async mode: a buffer of half the workers, and as many versions as make the same number of local
    trainings as `rounds` synchronous rounds would (training.rounds counts versions then)."""
    if options.mode != "async":
        return {}
    return {"mode": "async", "buffer_size": demo_buffer_size(options), "max_staleness": 10,
            "staleness": "polynomial"}


def demo_buffer_size(options: DemoOptions) -> int:
    """The async buffer: half the workers, so a version waits for the faster half, never the slowest."""
    return max(1, options.workers // 2)


def demo_versions(options: DemoOptions) -> int:
    """The rounds of the job: synchronous rounds, or (async) versions worth the same number of trainings."""
    if options.mode != "async":
        return options.rounds
    return max(1, options.rounds * options.workers // demo_buffer_size(options))


def free_port() -> int:
    """A loopback port free right now, for a service the demo starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(target: str, timeout_s: float = 60.0) -> None:
    """Block until the gRPC health check at `target` answers SERVING (raise after `timeout_s`): nothing is
    started against a service still coming up."""
    deadline = time.time() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"the service at {target} did not become healthy within {timeout_s:.0f}s")
            time.sleep(0.3)


class FederationFailed(FedbrokerError):
    """The demo's job ended failed: the command exits non-zero after printing what it has."""

    reason = "federation_failed"


class Cluster:
    """The processes and threads of one local federation; stops everything it started."""

    def __init__(self, options: DemoOptions, run_dir: Path) -> None:
        self.options = options
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.in_process: list[CoordinatorProcess | WorkerAgent] = []
        self.aggregator_target = f"127.0.0.1:{free_port()}"
        self.coordinator_target = f"127.0.0.1:{free_port()}"
        self.namespace = f"fedbroker-demo-{options.run_id}"
        self.secrets = run_dir / "secrets"
        self.tokens = self._make_tokens()

    def _make_tokens(self) -> dict[str, str]:
        """Authentication on, with tokens made for this run only: token tables for the two services, one token
        file per identity (mode 600), deleted when the run stops."""
        import yaml

        from fedbroker.rpc.auth import generate_token, hash_token

        workers = {f"worker-{i}": "worker" for i in range(self.options.workers)}
        tokens = {name: generate_token() for name in ["coordinator", "demo", *workers]}
        self.secrets.mkdir(mode=0o700, exist_ok=True)
        tables = {"aggregator": {"coordinator": "coordinator", **workers}, "coordinator": {"demo": "submitter"}}
        for service, identities in tables.items():
            table = {name: {"role": role, "sha256": hash_token(tokens[name])} for name, role in identities.items()}
            (self.secrets / f"{service}-tokens.yaml").write_text(yaml.safe_dump(table))
        for name, token in tokens.items():
            fd = os.open(self.secrets / f"{name}.token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token)
        return tokens

    def token_file(self, identity: str) -> str:
        """Where `identity`'s token lies for this run (a process reads it from the file, not its environment)."""
        return str(self.secrets / f"{identity}.token")

    def client(self) -> CoordinatorClient:
        """A coordinator client holding the demo's own submitter token."""
        from fedbroker.coordinator.service import CoordinatorClient
        from fedbroker.rpc.auth import ClientSecurity

        return CoordinatorClient(self.coordinator_target, security=ClientSecurity(token=self.tokens["demo"]))

    def env(self, **settings: Any) -> dict[str, str]:
        """A child's environment: this run's addresses, folders and token tables as FEDBROKER__ variables
        (`settings` on top), and none of the caller's own FEDBROKER__ settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
        base = {
            "broker.url": self.options.broker, "broker.namespace": self.namespace,
            "aggregator.listen": self.aggregator_target, "aggregator.target": self.aggregator_target,
            "coordinator.listen": self.coordinator_target, "coordinator.target": self.coordinator_target,
            "coordinator.state_dir": str(self.run_dir / "coordinator"),
            "aggregator.tokens_file": str(self.secrets / "aggregator-tokens.yaml"),
            "coordinator.tokens_file": str(self.secrets / "coordinator-tokens.yaml"),
        }
        for key, value in {**base, **settings}.items():
            env["FEDBROKER__" + key.upper().replace(".", "__")] = json.dumps(value) if not isinstance(value, str) else value
        return env

    def worker_settings(self, i: int) -> dict[str, Any]:
        """Worker `i`'s settings: its shard of the data set, its ledger and the DP policy of the flags."""
        o = self.options
        return {
            "worker.id": f"worker-{i}", "worker.categories": o.dataset, "worker.dataset": o.dataset,
            "worker.partition.scheme": o.partition, "worker.partition.num_clients": o.workers,
            "worker.partition.client_index": i, "worker.partition.alpha": o.alpha,
            "worker.partition.seed": o.seed, "worker.ledger_path": str(self.run_dir / f"worker-{i}-ledger.json"),
            "worker.dp.enabled": o.dp, "worker.dp.noise_multiplier": o.noise_multiplier,
            "worker.dp.max_grad_norm": o.max_grad_norm, "worker.dp.delta": o.delta,
            "worker.dp.epsilon_budget": o.epsilon_budget, "worker.heartbeat_s": 2.0,
            "client.token_file": self.token_file(f"worker-{i}"),
        }

    def spawn(self, name: str, command: str, env: dict[str, str]) -> None:
        """Start `fedbroker <command>` as a child process, its output in logs/<name>.log."""
        log_file = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (the child writes it until it stops)
        proc = subprocess.Popen([sys.executable, "-m", "fedbroker", command], env=env, stdout=log_file,
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)

    def start(self) -> None:
        """The aggregation service as a process, then the coordinator and the workers: processes over a
        broker, or in this process over the in-process bus."""
        from fedbroker.app.launch import start_coordinator, start_worker
        from fedbroker.config import load_config

        self.spawn("aggregator", "aggregator", self.env())
        wait_healthy(self.aggregator_target)
        coordinator_env = self.env(**{"client.token_file": self.token_file("coordinator")})
        if self.options.broker:
            self.spawn("coordinator", "coordinator", coordinator_env)
            for i in range(self.options.workers):
                self.spawn(f"worker-{i}", "worker", self.env(**self.worker_settings(i)))
            self._wait_coordinator()
        else:
            from fedbroker.worker.ledger import fresh_ledgers

            self.in_process.append(start_coordinator(load_config(environ=coordinator_env)))
            with fresh_ledgers():  # this run's folder is new: so is every worker's ledger
                for i in range(self.options.workers):
                    self.in_process.append(start_worker(load_config(environ=self.env(**self.worker_settings(i)))))

    def _wait_coordinator(self, timeout_s: float = 60.0) -> None:
        client = self.client()
        client.timeout_s = 2
        deadline = time.time() + timeout_s
        try:
            while True:
                self.check_alive()
                try:
                    client.status()
                    return
                except grpc.RpcError:
                    if time.time() > deadline:
                        raise TimeoutError(f"the coordinator did not answer within {timeout_s:.0f}s") from None
                    time.sleep(0.3)
        finally:
            client.close()

    def check_alive(self) -> None:
        """Raise, naming its log folder, when a child process has exited: the demo stops instead of waiting."""
        for proc in self.procs:
            if proc.poll() is not None:
                command = proc.args[-1] if isinstance(proc.args, list) else proc.args
                name = Path(str(command)).name
                raise RuntimeError(f"a {name} process exited with code {proc.returncode}; see {self.logs}")

    def stop(self) -> None:
        """Stop everything this cluster started, delete its tokens and, over a broker, its queues."""
        for part in self.in_process:
            part.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(self.secrets, ignore_errors=True)  # this run's tokens die with it
        if self.options.broker:  # this run's namespace is private to it: leave nothing behind on the broker
            from fedbroker.bus import delete_topology

            delete_topology(self.options.broker, self.namespace, [f"worker-{i}" for i in range(self.options.workers)])


def baseline_training(job: JobSpec) -> TrainingConfig:
    """The job's training settings for one pooled run as long as all its rounds together."""
    return replace(job.training, local_epochs=job.training.rounds * job.training.local_epochs)


def centralized_baseline(options: DemoOptions, model_spec: ModelSpec, training: TrainingConfig) -> float:
    """The same model trained on the pooled training data without DP: the ceiling federation aims at."""
    from fedbroker.datasets import load_dataset, train_test_split
    from fedbroker.evaluation import evaluate
    from fedbroker.model import build_model
    from fedbroker.worker.training import train_local

    data = load_dataset(options.dataset)
    train, test = train_test_split(data, test_fraction=0.2, seed=0)
    model = build_model(model_spec, seed=options.seed)
    train_local(model, train.x, train.y, dp=None, seed=options.seed, config=training)
    return evaluate(model, test.x, test.y)[0]


def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run the federation, then the pooled baseline; write results.json and accuracy.png, print the table."""
    from fedbroker.datasets import load_dataset

    check_options(options)  # the demo's own options first, by their flags, before a run folder exists
    data = load_dataset(options.dataset)
    shards = shard_sizes(options, data)
    options = fit_training(options, shards)
    run_dir = Path(options.out) / options.run_id
    job = demo_job(options, data.input_shape, data.num_classes)
    spec = parse_job(job)  # the options checked before anything starts (the coordinator checks what it receives)
    pooled = baseline_training(spec)  # checked now too, though it trains only once the federation is done
    tracking.check_store(options.track, experiment=options.experiment)  # MLflow missing or its store unreachable: said before anything starts
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(job, indent=2))
    unit = "versions (async)" if options.mode == "async" else "rounds"
    privacy = (f"on (σ={options.noise_multiplier:g}, clip={options.max_grad_norm:g}, δ={options.delta:g}, planned ε "
               f"{planned_epsilon(options, shards):.2f} of its budget {options.epsilon_budget:g} per worker)"
               if options.dp else "off")
    split = f"{options.partition}{f' α={options.alpha}' if options.partition == 'dirichlet' else ''}"
    print(f"fedbroker demo: {options.workers} workers, {demo_versions(options)} {unit}, {options.dataset} ({split}), "
          f"batch {options.batch_size}, {options.local_epochs} local epoch(s), DP {privacy}, "
          f"bus: {'RabbitMQ' if options.broker else 'in-process'}; run folder {run_dir}")
    params = {f"demo.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in vars(options).items()
              if k not in ("broker", "out", "run_id", "track", "experiment")}
    started = time.time()
    job_id, status = run_tracked(Cluster(options, run_dir), json.dumps(job), track=options.track,
                                 experiment=options.experiment, params=params)
    job_row = status.jobs[0]
    print("training the centralised (pooled data, no DP) baseline ...")
    baseline = centralized_baseline(options, spec.model, pooled)
    results = collect_results(status, job_id, options, baseline, time.time() - started)
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, run_dir / "accuracy.png")
    print_table(results)
    print(f"results: {run_dir / 'results.json'}   plot: {run_dir / 'accuracy.png'}")
    if job_status(job_row) is JobStatus.FAILED:
        raise FederationFailed(f"the federation stopped after {job_row.rounds_done} round(s): {job_row.error}")
    return results


def collect_results(status: pb.StatusReply, job_id: str, options: DemoOptions, baseline: float, seconds: float) -> dict[str, Any]:
    """results.json's contents: per round accuracy, losses and ε, the refusals, and a summary."""
    rounds: list[dict[str, Any]] = []
    for r in (r for r in status.rounds if round_status(r) is RoundStatus.CLOSED):
        epsilon = {p.worker_id: round(p.epsilon, 4) for p in status.participants
                   if p.round == r.round and participant_status(p) in SENT and options.dp}
        rounds.append({"round": r.round, "clients": r.aggregated, "mean_train_loss": round(r.mean_train_loss, 4),
                       "accuracy": round(r.accuracy, 4), "loss": round(r.loss, 4), "epsilon": epsilon,
                       "seconds": round(r.seconds, 2), "model_version": r.model_version,
                       "mean_staleness": round(r.mean_staleness, 2),  # and the sites' own score, if they gave one
                       "site_accuracy": round(r.federated_accuracy, 4) if r.federated_samples else None,
                       "site_metric": r.federated_metric or "accuracy"})
    refusals = [{"round": p.round, "worker": p.worker_id, "status": p.status, "reason": p.reason}
                for p in status.participants if participant_status(p) in REFUSED_OR_FAILED]
    return {
        "job_id": job_id,
        "options": {k: v for k, v in vars(options).items() if k != "broker"},
        "rounds": rounds,
        "refusals": refusals,
        "unit": "version" if options.mode == "async" else "round",
        "summary": {
            "status": status.jobs[0].status if status.jobs else "unknown",
            "error": status.jobs[0].error if status.jobs else "",
            "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
            "centralized_accuracy": round(baseline, 4),
            "broker": "rabbitmq" if options.broker else "in-process",
            "dp": options.dp,
            "max_epsilon": max((max(r["epsilon"].values()) for r in rounds if r["epsilon"]), default=None),
            "seconds": round(seconds, 1),
        },
    }


def _site_head(rounds: list[dict[str, Any]]) -> str:
    """The sites' column names the task's headline score (site acc, site mae, site dice, site macro_f1)."""
    metric = next((r.get("site_metric") for r in rounds if r.get("site_accuracy") is not None), "accuracy")
    return "site acc" if metric in (None, "accuracy") else f"site {metric}"


def print_table(results: dict[str, Any]) -> None:
    """The per-round (or per-version) table and the summary line under it."""
    workers = sorted({w for r in results["rounds"] for w in r["epsilon"]})
    versions = results.get("unit") == "version"  # async: a row per global version, with its staleness
    sites = any(r.get("site_accuracy") is not None for r in results["rounds"])  # federated evaluation's column
    head = ["version" if versions else "round", "clients", *(["staleness"] if versions else []), "train loss",
            "test acc", *([_site_head(results["rounds"])] if sites else []), *[f"ε {w}" for w in workers], "seconds"]
    rows = [[str(r["model_version"] if versions else r["round"]), str(r["clients"]),
             *([f"{r['mean_staleness']:.2f}"] if versions else []), f"{r['mean_train_loss']:.4f}",
             f"{r['accuracy']:.4f}", *([_score(r.get("site_accuracy"))] if sites else []),
             *[f"{r['epsilon'][w]:.3f}" if w in r["epsilon"] else "—" for w in workers], f"{r['seconds']:.1f}"]
            for r in results["rounds"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths))
    print()
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    s = results["summary"]
    print("-" * len(line))
    final = f"{s['final_accuracy']:.4f}" if s["final_accuracy"] is not None else "n/a"
    print(f"final federated accuracy {final}  |  centralised no-DP baseline "
          f"{s['centralized_accuracy']:.4f}  |  bus {s['broker']}  |  {s['seconds']:.0f}s")
    for r in results["refusals"]:
        print(f"{results.get('unit', 'round')} {r['round']}: {r['worker']} {r['status']}: {r['reason']}")


def _score(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "—"


def plot(results: dict[str, Any], path: Path, *, title: str | None = None) -> None:
    """accuracy.png: global accuracy per round against the pooled baseline, and each worker's ε spent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in results["rounds"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(rounds, [r["accuracy"] for r in results["rounds"]], marker="o",
            label="federated" + (" (DP)" if results["summary"]["dp"] else ""))
    ax.axhline(results["summary"]["centralized_accuracy"], color="grey", linestyle="--",
               label="centralised, no DP")
    ax.set_xlabel(results.get("unit", "round"))
    ax.set_ylabel("global test accuracy")
    ax.set_ylim(0, 1)
    if len(rounds) <= 30:
        ax.set_xticks(rounds)
    ax.grid(alpha=0.3)
    if results["summary"]["dp"] and results["rounds"] and results["rounds"][-1]["epsilon"]:
        twin = ax.twinx()
        for worker in sorted(results["rounds"][-1]["epsilon"]):
            twin.plot(rounds, [r["epsilon"].get(worker) for r in results["rounds"]], linestyle=":", alpha=0.7,
                      label=f"ε {worker}")
        twin.set_ylabel("ε spent (δ fixed)")
        twin.legend(loc="lower right", fontsize=7)
    ax.legend(loc="lower center", fontsize=8)
    ax.set_title(title or f"fedbroker demo: {results['options']['dataset']}, {results['options']['workers']} workers")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
