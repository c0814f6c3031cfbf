"""In-process federated simulation over the service's own code paths, for research experiments.

Many virtual workers train with `worker.training.train_local` and upload through
`aggregators.round_book.RoundBook.receive_update`, fed by `fedbroker.rpc.codec.stream_messages` exactly as the
gRPC servicer feeds it; rounds are opened and closed as the coordinator does (participants from
`coordinator.participants.sample_participants`, histograms for class shares, a population label
distribution for ISH). So an algorithm measured here is the algorithm the service runs, not a copy.
Workers train one after another: no threads, no network, seeded throughout.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from torch import nn

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.algorithms.catalogue import aggregation_settings
from fedbroker.close_report import Verdict
from fedbroker.config import DPPolicy
from fedbroker.coordinator.participants import sample_participants
from fedbroker.datasets import Dataset, load_dataset, train_test_split
from fedbroker.errors import BudgetExceeded
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import JobSpec, ModelSpec, parse_job, parse_model
from fedbroker.label_stats import population_distribution, reported_ish
from fedbroker.layers import LAYERS
from fedbroker.model import build_model, initial_weights, load_numpy_state
from fedbroker.privacy import HistoryEntry
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.worker.partition import partition
from fedbroker.worker.training import TrainResult, train_local

Metrics = Callable[[nn.Module, Dataset], dict[str, float]]
Tamper = Callable[[int, dict[str, np.ndarray], dict[str, TrainResult]], dict[str, TrainResult]]

JOB_ID = "sim"
MIN_WORKER_SAMPLES = 10  # as in the PFNM/NAFI reference partitions; lowered when the data are too few


@dataclass(frozen=True)
class VirtualWorker:
    worker_id: str
    x: np.ndarray
    y: np.ndarray
    num_classes: int

    @property
    def histogram(self) -> np.ndarray:
        return np.bincount(self.y, minlength=self.num_classes)


def make_workers(
    dataset: str,
    *,
    num_workers: int,
    scheme: str,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    test_fraction: float = 0.2,
) -> tuple[list[VirtualWorker], Dataset]:
    """A stratified test split and the rest partitioned among `num_workers` (ids w00, w01, ...)."""
    train, test = train_test_split(load_dataset(dataset), test_fraction=test_fraction, seed=seed)
    parts = partition(
        train.y, scheme=scheme, num_clients=num_workers, seed=seed, alpha=alpha,
        classes_per_client=classes_per_client, min_size=min(MIN_WORKER_SAMPLES, len(train) // num_workers),
    )
    width = max(2, len(str(num_workers - 1)))
    workers = [
        VirtualWorker(f"w{i:0{width}d}", train.x[idx], train.y[idx], train.num_classes) for i, idx in enumerate(parts)
    ]
    return workers, test


@dataclass
class RoundRecord:
    round: int
    accuracy: float
    loss: float
    participants: int
    aggregated: int
    seconds: float
    stats: dict[str, float]
    widths: list[int]
    train_loss: float
    extra: dict[str, float] = field(default_factory=dict)
    verdicts: list[Verdict] = field(default_factory=list)  # the robust rule's, one per judged update


@dataclass
class Simulation:
    rounds: list[RoundRecord]
    final_state: dict[str, np.ndarray]
    final_spec_json: str


def classification_metrics(model: nn.Module, test: Dataset) -> dict[str, float]:
    """AUC (binary, or one-vs-rest macro), macro F1 and balanced accuracy of `model` on `test`."""
    import torch
    from sklearn.metrics import balanced_accuracy_score, f1_score, roc_auc_score

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(torch.from_numpy(np.asarray(test.x, dtype=np.float32)))
            prob = torch.softmax(logits.double(), dim=1).numpy()
    finally:
        model.train(was_training)
    pred = prob.argmax(axis=1)
    out = {
        "f1_macro": float(f1_score(test.y, pred, average="macro", labels=list(range(test.num_classes)), zero_division=0)),
        "balanced_accuracy": float(balanced_accuracy_score(test.y, pred)),
    }
    try:
        if test.num_classes == 2:
            out["auc"] = float(roc_auc_score(test.y, prob[:, 1]))
        else:
            out["auc"] = float(roc_auc_score(test.y, prob, multi_class="ovr", average="macro",
                                             labels=list(range(test.num_classes))))
    except ValueError:  # a class absent from the test split: AUC is undefined, say so rather than guess
        out["auc"] = math.nan
    return out


def widths_of(spec: ModelSpec) -> list[int]:
    """Output width of every layer alignment matches (Linear, Conv2d), in order (the last one is the number of
    classes)."""
    return [int(layer.params[LAYERS[layer.type].out_width]) for layer in spec.layers if LAYERS[layer.type].weighted]


def training_seed(job_seed: int, round_number: int, worker_index: int) -> int:
    """A non-negative 63-bit seed per (job, round, worker), so workers never share batch orders."""
    return int(np.random.SeedSequence([job_seed, round_number, worker_index]).generate_state(1, np.uint64)[0] >> 1)


def simulate(
    job: Mapping[str, Any] | JobSpec,
    workers: Sequence[VirtualWorker],
    test: Dataset,
    *,
    dp: DPPolicy | Mapping[str, DPPolicy] | None = None,
    initial_state: dict[str, np.ndarray] | None = None,
    progress: bool = True,
    metrics: Metrics | None = None,
    probe: Dataset | None = None,
    first_states: Mapping[str, dict[str, np.ndarray]] | None = None,
    tamper: Tamper | None = None,
    frozen: Collection[str] = (),
) -> Simulation:
    """Play the coordinator's round loop in-process and evaluate the global model on `test` after each round.

    `initial_state` (default: the job seed's initial weights) lets several methods start from the same
    weights. `metrics` adds extras to each round's record; None means `classification_metrics`. `probe`: the
    probe set the service holds for a GA `fitness: probe` job (its first `probe_size` samples), in place of
    the bundled one, so an experiment can keep it apart from both the workers' data and the test set.
    `first_states`: a worker's own starting weights for round 1 (independent initialisation), in place of
    the global model; from round 2 on every worker starts from the global model.
    `tamper(round, global_state, trained)`: what the round's workers upload instead of what they trained (a
    poisoning experiment's attackers), called once every chosen worker has trained.
    A worker whose DP budget would be exceeded refuses the round, as a real one does; a round nobody
    uploads to ends the simulation early. `dp` is one policy for every worker or each worker's own (by id;
    a worker absent from the mapping trains without DP), as each data owner sets its own.
    `frozen`: tensor names that do not train (`train_local(frozen=...)`, as a `model.freeze` job's sites
    train). They travel in the upload, where the service's sites leave them out and the service keeps the
    global ones; the mean of equal float32 tensors is not always them to the bit (the BLAS kernel may scale
    the sum by 1/Σn after adding), so the global model is read here with them put back, and a site whose
    training changed one is an error.
    """
    spec = job if isinstance(job, JobSpec) else parse_job(job)
    metrics = classification_metrics if metrics is None else metrics
    ids = [w.worker_id for w in workers]
    if len(set(ids)) != len(ids):
        raise ValueError("virtual workers must have distinct ids")
    index = {w.worker_id: i for i, w in enumerate(workers)}
    by_id = {w.worker_id: w for w in workers}
    histograms = {w.worker_id: [int(c) for c in w.histogram] for w in workers}
    population = population_distribution([w.histogram for w in workers])
    aggregation = asdict(spec.aggregation)
    settings = aggregation_settings(spec.aggregation)
    training = spec.training

    # No time limits: the service's (then the weighted mean, or the previous selection) would let the machine's
    # load decide which method a run measured.
    unlimited = {"alignment_time_limit_s": math.inf, "selection_time_limit_s": math.inf}
    book = RoundBook(**unlimited) if probe is None else RoundBook(
        probe_sets=lambda _name, size, _seed: (probe.x[:size], probe.y[:size]), **unlimited)
    state = initial_state if initial_state is not None else initial_weights(spec.model, seed=spec.seed)
    kept = {name: np.array(state[name]) for name in frozen}  # never trained: the service keeps them as they are
    book.put_global(JOB_ID, 1, spec.model.to_json(), state)
    ledgers: dict[str, list[HistoryEntry]] = {w: [] for w in ids}
    records: list[RoundRecord] = []

    rounds = range(1, training.rounds + 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(rounds, desc=f"{spec.name} [{spec.aggregation.alignment}/{spec.aggregation.weighting}/"
                                f"{spec.aggregation.selection}]", leave=False)
        rounds = bar
    for r in rounds:
        started = time.perf_counter()
        chosen = sample_participants(ids, spec.schedule.clients_per_round, seed=spec.seed, round_number=r)
        version = book.open_round(JOB_ID, r, chosen, deadline=math.inf, aggregation=aggregation, seed=spec.seed,
                                  histograms={w: histograms[w] for w in chosen})
        _, spec_json, served = book.global_model(JOB_ID, version)
        weights = {**served, **kept}
        model_spec = parse_model(json.loads(spec_json))
        losses, counts = [], []
        trained: dict[str, TrainResult] = {}
        for worker_id in chosen:
            worker = by_id[worker_id]
            model = build_model(model_spec)
            own = first_states.get(worker_id) if first_states is not None and r == 1 else None
            loaded = weights if own is None else own
            load_numpy_state(model, loaded)
            try:
                own_dp = dp.get(worker_id) if isinstance(dp, Mapping) else dp
                result = train_local(model, worker.x, worker.y, config=training, dp=own_dp,
                                     history=ledgers[worker_id], seed=training_seed(spec.seed, r, index[worker_id]),
                                     frozen=frozen)
            except BudgetExceeded:
                continue
            moved = [name for name in frozen if not np.array_equal(result.state[name], loaded[name])]
            if moved:
                raise RuntimeError(f"worker {worker_id} changed frozen tensor {moved[0]!r} in round {r}")
            ledgers[worker_id] = list(result.history)
            trained[worker_id] = result
            losses.append(result.train_loss)
            counts.append(result.num_samples)
        sent = tamper(r, weights, trained) if tamper is not None else trained
        for worker_id, result in sent.items():
            upload(book, JOB_ID, round_number=r, worker_id=worker_id, result=result,
                   ish=reported_ish(by_id[worker_id].histogram, population, participants=len(chosen),
                                    settings=settings))
        if not losses:
            break
        closed = book.close(JOB_ID, r)
        model, model_spec = global_network(book, JOB_ID, kept=kept)
        accuracy, loss = evaluate(model, test.x, test.y)
        extra = metrics(model, test)
        records.append(RoundRecord(
            round=r, accuracy=accuracy, loss=loss, participants=len(chosen), aggregated=len(closed.aggregated),
            seconds=time.perf_counter() - started, stats=dict(closed.stats), widths=widths_of(model_spec),
            train_loss=float(np.average(losses, weights=counts)), extra=dict(extra),
            verdicts=list(closed.verdicts),
        ))
        if bar is not None:
            bar.set_postfix(acc=f"{accuracy:.3f}", loss=f"{loss:.3f}")
    _, final_spec_json, final_state = book.global_model(JOB_ID)
    return Simulation(rounds=records, final_state={**final_state, **kept}, final_spec_json=final_spec_json)


def upload(book: RoundBook, job_id: str, *, round_number: int, worker_id: str, result: TrainResult,
           ish: float | None = None) -> None:
    """Stream one trained update into `book` the way the gRPC servicer does (header, chunks, digest)."""
    header = pb.UpdateHeader(
        job_id=job_id, round=round_number, worker_id=worker_id, num_samples=result.num_samples,
        tensors=codec.tensor_specs(result.state), ish=ish or 0.0, has_ish=ish is not None,
        epsilon=result.epsilon or 0.0, train_loss=result.train_loss,
    )
    book.receive_update(codec.stream_messages(pb.UpdateChunk, header, result.state))


def global_network(book: RoundBook, job_id: str, *,
                   kept: Mapping[str, np.ndarray] | None = None) -> tuple[nn.Module, ModelSpec]:
    """The book's latest global model as a torch module, built from the spec it returned (widths may grow);
    `kept`: frozen tensors, which the service never averages (`simulate`)."""
    _, spec_json, state = book.global_model(job_id)
    spec = parse_model(json.loads(spec_json))
    model = build_model(spec)
    load_numpy_state(model, {**state, **(kept or {})})
    return model, spec


