"""`fedbroker simulate job.yaml`: your own job, run on this machine before it is submitted to a federation.

The demo's engine runs it (`fedbroker.app.demo.Cluster`): the aggregation service as its own process, the
coordinator and N workers in this process (or every one a process of its own, with `--broker`). The workers
hold a bundled set or your own data (a worker config file, as a data owner would run it), split between them
as `--partition` says. The job goes through the same checks as a submission, and first the one the
coordinator makes against its workers' registrations, so a model that does not fit the data is refused
before anything starts. Each round's global model is then scored on the held-out part of that data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedbroker.app import tracking
from fedbroker.app.demo import (
    Cluster,
    DemoOptions,
    FederationFailed,
    baseline_training,
    collect_results,
    plot,
    print_table,
)
from fedbroker.app.progress import dp_policy, run_tracked
from fedbroker.app.replies import job_status
from fedbroker.app.unfilled import refuse_unfilled
from fedbroker.config import DPPolicy, WorkerConfig, load_config
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import JobSpec, ModelSpec
from fedbroker.job.status import JobStatus


@dataclass(frozen=True)
class SimulateOptions:
    """The `fedbroker simulate` flags."""

    job: str                           # the job file (YAML or JSON), as `fedbroker submit` takes it
    workers: int = 3
    partition: str = "iid"             # iid | dirichlet | classes
    alpha: float = 0.5                 # Dirichlet α (partition dirichlet)
    dataset: str = ""                  # a bundled set; "" = worker_config, else the job's evaluation set
    worker_config: str = ""            # a worker config file: its `worker` section names the data (and DP policy)
    dp: bool = True                    # without worker_config: DP on with the demo's policy, or off
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    epsilon_budget: float = 10.0
    broker: str = ""
    out: str = "runs"
    seed: int = 0
    track: str | None = None           # MLflow: None = no tracking, "" = MLflow's default store, else its URI
    experiment: str = ""               # the MLflow experiment (default: the job's name)


class SimulationCluster(Cluster):
    """The demo's cluster, whose workers hold the simulation's data and serve the job's category."""

    def __init__(self, options: DemoOptions, run_dir: Path, *, data: WorkerConfig, category: str,
                 own_policy: bool) -> None:
        super().__init__(options, run_dir)
        self.data, self.category, self.own_policy = data, category, own_policy

    def worker_settings(self, i: int) -> dict[str, Any]:
        """The demo worker's settings, with the simulation's data (and its owner's DP policy, if given)."""
        settings = super().worker_settings(i)
        w = self.data
        settings.update({
            "worker.categories": [self.category], "worker.dataset": w.dataset, "worker.idx_dir": w.idx_dir,
            "worker.test_fraction": w.test_fraction, "worker.split_seed": w.split_seed,
            **{f"worker.data.{f.name}": _setting(getattr(w.data, f.name)) for f in dataclasses.fields(w.data)},
        })
        if self.own_policy:  # the data owner's file names its DP policy: simulate under that one
            settings.update({f"worker.dp.{f.name}": getattr(w.dp, f.name) for f in dataclasses.fields(w.dp)})
        return settings


def _setting(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


DATA_VARIABLES = "FEDBROKER__WORKER__DATA__"  # what simulate honours of a worker's environment


def simulation_data(options: SimulateOptions, job: JobSpec) -> WorkerConfig:
    """The `worker` section every simulated worker starts from: the owner's file, a bundled set, or the set
    the job is evaluated on."""
    if options.worker_config:
        if options.dataset:
            raise ConfigError("--dataset", "give either a bundled set or --worker-config, not both")
        # the file plus the data section's variables, as a worker would read them; the rest of a real worker's
        # environment (its broker, id, ledger) is no business of a simulation on this machine
        environ = {k: v for k, v in os.environ.items() if k.startswith(DATA_VARIABLES)}
        worker = load_config(options.worker_config, environ=environ).worker
        refuse_unfilled(worker, options.worker_config)  # a kit's worker.yaml whose data is still FILL-IN
        return worker
    name = options.dataset or job.evaluation.dataset
    if not name:
        raise ConfigError("--dataset", "the job names no evaluation set: give a bundled set (--dataset digits) "
                                       "or your own data (--worker-config worker.yaml)")
    return WorkerConfig(dataset=name)


def check_simulation(options: SimulateOptions, job: JobSpec, data: Any) -> None:
    """What would make the simulation wait or fail for reasons other than the job: named before anything runs."""
    from fedbroker.coordinator.participants import data_fit_problems
    from fedbroker.coordinator.records import WorkerRecord

    problems = data_fit_problems(job.model, [WorkerRecord(
        worker_id="simulated", categories=(job.category,), histogram=(), dp=DPPolicy(enabled=False),
        epsilon_spent=0.0, device="cpu", num_samples=len(data), last_seen=0.0, input_shape=tuple(data.input_shape),
        num_classes=data.num_classes)], category=job.category, who=lambda _: "the simulated workers",
        pipeline=job.data.pipeline)
    if not 1 <= options.workers <= 64:
        problems.append(ConfigError("--workers", f"must lie in [1, 64], got {options.workers}"))
    else:
        needed = max(job.schedule.min_workers, job.schedule.min_clients)
        if needed > options.workers:
            which = "min_workers" if job.schedule.min_workers == needed else "min_clients"
            problems.append(ConfigError("--workers", f"is {options.workers} but the job's schedule.{which} is "
                                                     f"{needed}: simulate at least that many"))
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


def run_simulation(options: SimulateOptions) -> dict[str, Any]:
    """Run the job on the simulated workers; each round scored on the held-out data, as the demo reports."""
    from fedbroker.datasets import load_worker_data, train_test_split
    from fedbroker.job.submission import accept_job_text

    with open(options.job, encoding="utf-8") as fh:
        text = fh.read()
    job = accept_job_text(text)  # every check a submission gets
    data_config = simulation_data(options, job)
    data = load_worker_data(data_config)
    check_simulation(options, job, data)
    tracking.check_store(options.track, experiment=options.experiment)
    train, test = train_test_split(data, test_fraction=data_config.test_fraction, seed=data_config.split_seed)
    label = data_config.data.path or data_config.idx_dir or data_config.dataset
    demo = DemoOptions(workers=options.workers, rounds=job.training.rounds, alpha=options.alpha,
                       partition=options.partition, dp=data_config.dp.enabled if options.worker_config else options.dp,
                       dataset=data_config.dataset, broker=options.broker, out=options.out, seed=options.seed,
                       noise_multiplier=options.noise_multiplier, max_grad_norm=options.max_grad_norm,
                       epsilon_budget=options.epsilon_budget, mode=job.schedule.mode)
    run_dir = Path(options.out) / f"simulate-{demo.run_id}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps(json.loads(job.to_json()), indent=2))
    policy = data_config.dp if options.worker_config else demo  # the owner's file's policy, else the flags'
    unit = "versions (async)" if job.schedule.mode == "async" else "rounds"
    print(f"fedbroker simulate: job {job.name!r} ({job.training.rounds} {unit}), {options.workers} workers on "
          f"{label} ({data_config.dataset}, {len(train)} training samples, {options.partition}), DP "
          f"{dp_policy(enabled=demo.dp, noise_multiplier=policy.noise_multiplier, max_grad_norm=policy.max_grad_norm, delta=policy.delta, epsilon_budget=policy.epsilon_budget)}, "
          f"bus {'RabbitMQ' if options.broker else 'in-process'}; run folder {run_dir}")
    cluster = SimulationCluster(demo, run_dir, data=data_config, category=job.category,
                                own_policy=bool(options.worker_config))
    started = time.time()
    job_id, status = run_tracked(cluster, text, track=options.track, experiment=options.experiment,
                                 params=simulation_params(options))
    accuracy = score_rounds(run_dir / "coordinator" / "checkpoints", job_id, test, job=job)
    print("training the centralised (pooled data, no DP) baseline ...")
    baseline = pooled_baseline(job, train, test, seed=options.seed)
    results = collect_results(status, job_id, demo, baseline, time.time() - started)
    for row in results["rounds"]:  # scored here, on the simulated data's held-out part
        row["accuracy"] = accuracy.get(row["round"], row["accuracy"])
    results["options"] = {**{k: v for k, v in vars(options).items() if k != "broker"}, "data": label}
    results["summary"]["final_accuracy"] = results["rounds"][-1]["accuracy"] if results["rounds"] else None
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, run_dir / "accuracy.png",
         title=f"{job.name}: {options.workers} workers on {Path(label).name}")
    print_table(results)
    print(f"results: {run_dir / 'results.json'}   plot: {run_dir / 'accuracy.png'}")
    row = status.jobs[0]
    if job_status(row) is JobStatus.FAILED:
        raise FederationFailed(f"the job stopped after {row.rounds_done} round(s): {row.error}")
    return results


def simulation_params(options: SimulateOptions) -> dict[str, str]:
    """The simulation's own settings, logged beside the job's (`simulate.workers`, ...)."""
    skip = {"job", "out", "broker", "track", "experiment"}
    return {f"simulate.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in vars(options).items()
            if k not in skip}


def score_rounds(checkpoint_dir: Path, job_id: str, test: Any, *, job: JobSpec | None = None) -> dict[int, float]:
    """Each round's global model (the coordinator's checkpoints) scored on the held-out samples (prepared by the
    job's data pipeline, as the sites prepare theirs)."""
    from fedbroker.coordinator.checkpoints import checkpoints_of, load_checkpoint
    from fedbroker.evaluation import evaluate
    from fedbroker.job.spec import parse_model
    from fedbroker.model import build_model, load_numpy_state

    scores = {}
    for path in checkpoints_of(checkpoint_dir, job_id):
        tensors, spec_json = load_checkpoint(path)
        model = build_model(parse_model(json.loads(spec_json)))
        load_numpy_state(model, tensors)
        scores[int(path.stem.split("-")[1])] = round(evaluate(model, _prepared(job, test.x), test.y)[0], 4)
    return scores


def pooled_baseline(job: JobSpec, train: Any, test: Any, *, seed: int) -> float:
    """The job's model trained on all the simulated training data at once, without DP: the ceiling."""
    from fedbroker.evaluation import evaluate
    from fedbroker.model import build_model
    from fedbroker.worker.training import train_local

    spec = job.model
    if job.data.standardize == "federated":  # the sites' rows are raw: standardise as the federation does, here
        spec = pooled_standardization(spec, train.x)  # with the pooled data's exact mean and std (no DP)
    model = build_model(spec, seed=seed)
    pipeline = job.data.pipeline if job.data.pipeline.preprocess or job.data.pipeline.augment else None
    train_local(model, train.x, train.y, dp=None, seed=seed, config=baseline_training(job), pipeline=pipeline)
    return evaluate(model, _prepared(job, test.x), test.y)[0]


def _prepared(job: JobSpec | None, x: Any) -> Any:
    """The held-out samples as the job's preprocessing prepares them (as they are without one)."""
    if job is None or not job.data.pipeline.preprocess:
        return x
    from fedbroker.datasets.stream import batch_reader

    return batch_reader(x, job.data.pipeline, mask=False)(np.arange(len(x)))


def pooled_standardization(model: ModelSpec, x: np.ndarray) -> ModelSpec:
    """`model` with a standardize layer of `x`'s exact per-feature mean and std in front (a constant feature
    keeps std 1)."""
    from fedbroker.job.spec import parse_model

    flat = x.reshape(len(x), -1).astype(np.float64)
    std = flat.std(axis=0)
    layer = {"type": "standardize", "mean": [float(v) for v in flat.mean(axis=0)],
             "std": [float(v) if v > 0 else 1.0 for v in std]}
    return parse_model({"input_shape": list(model.input_shape), "layers": [layer, *(x.to_dict() for x in model.layers)]})
