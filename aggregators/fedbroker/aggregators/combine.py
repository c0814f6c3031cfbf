"""A closing round's accepted updates → the next global model: selection, weighting, then the mean, an
alignment, or a robust rule over the chosen updates Δ_i = x_i − x_global (`aggregation.robust`).

Pure given the round: no locks (the round is CLOSING, so nothing is added meanwhile), and no I/O but
reading the bundled probe set a GA round with `fitness: probe` or an FLTrust round asks for
(`aggregators.probe_sets`, cached); FLTrust's root update g_0 is trained on it here (`aggregators.root_update`).

Every stage has a cooperative time limit, so a close ends within minutes whatever the job asked for:
selection past `selection_time_limit_s` falls back to a random choice (the GA says why); an alignment past
`alignment_time_limit_s` stops and the round's model is the plain weighted mean of the chosen updates
(FedAvg of the same coefficients: every update has the global model's shapes), logged and recorded as
`alignment_fallback = 1` in the close's stats. A robust rule needs no limit: its parameters are bounded so
that it costs a few passes over the updates (docs/performance.md), plus FLTrust's few SGD steps on a probe set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from fedbroker.aggregators.alignment import AlignInput, DeadlinePassed
from fedbroker.aggregators.job_state import Accepted, CloseResult, Round, UpdateSummary
from fedbroker.aggregators.layer_conversion import from_layers, to_layers
from fedbroker.aggregators.mean import weighted_mean_of_rows
from fedbroker.aggregators.probe_sets import probe_arrays
from fedbroker.aggregators.robust import RobustInput, RobustMemory, RobustResult
from fedbroker.aggregators.root_update import train_root_update
from fedbroker.aggregators.selection import Candidate, Probe, SelectionInput
from fedbroker.close_report import SelectionRecord, Verdict
from fedbroker.errors import Conflict
from fedbroker.job.alignment_plan import alignment_plan
from fedbroker.job.spec import ModelSpec

log = logging.getLogger(__name__)

ProbeLoader = Callable[[str, int, int], tuple[np.ndarray, np.ndarray]]
"""(dataset, size, seed) -> (x, y) of a probe set the service holds."""
RootTrainer = Callable[..., dict[str, np.ndarray]]
"""`train_root_update`'s signature: (spec, global state, x, y, *, epochs, lr, batch_size, seed) -> g_0 by tensor."""


@dataclass(frozen=True)
class Combined:
    """What a close made: the next global model and how it came about."""

    chosen: list[str]           # the workers whose updates went in
    weights: np.ndarray         # their coefficients, in `chosen`'s order
    spec: ModelSpec             # the new global model's spec (alignment may change widths)
    state: dict[str, np.ndarray]
    stats: dict[str, float]
    selection: SelectionRecord
    verdicts: list[Verdict]     # each chosen update as the robust rule judged it (none without a rule)
    excluded: list[str] = field(default_factory=list)  # sites a secure round excluded (failed its checks)
    memory: RobustMemory | None = None  # the robust rule's memory after this round (the job keeps it)

    def report(self, version: int, spec_json: str, seconds: float, updates: list[UpdateSummary]) -> CloseResult:
        """The close's result as the service keeps and returns it (a repeated close returns it again)."""
        return CloseResult(version, self.chosen, spec_json, self.stats, seconds, updates, self.selection,
                           self.verdicts, self.excluded)


def combine(rnd: Round, accepted: Mapping[str, Accepted], current: Mapping[str, np.ndarray], spec: ModelSpec, *,
            seed: int, selection_time_limit_s: float, alignment_time_limit_s: float = 120.0,
            probe_sets: ProbeLoader = probe_arrays, root_trainer: RootTrainer = train_root_update,
            memory: RobustMemory | None = None) -> Combined:
    """The next global model from a closing round's accepted updates (seeded by the job's seed and the round);
    `memory`: what the job's robust rule kept from its earlier rounds."""
    rng = np.random.default_rng([seed, rnd.number])
    stats: dict[str, float] = {"accepted": float(len(accepted))}
    verdicts: list[Verdict] = []
    robust = _RobustRun(probe_sets, root_trainer, memory)
    if rnd.rows.mean is not None:
        chosen = sorted(accepted)
        state, weights = _running_result(rnd, accepted, stats)
        selection = SelectionRecord(method=rnd.algorithms.settings.selection.name, accepted=len(accepted),
                                    chosen=len(chosen))
    else:
        chosen, weights, selection = _choose(rnd, accepted, current, spec, rng, stats, selection_time_limit_s,
                                             probe_sets)
        stats["selected"] = float(len(chosen))
        if rnd.algorithms.settings.robust.traits.needs_update_set:
            chosen, weights, state, verdicts = _robust(rnd, [accepted[w] for w in chosen], weights, current, spec,
                                                       rng, stats, robust)
        else:
            spec, state = _combine(rnd, spec, [accepted[w] for w in chosen], weights, rng, stats, current,
                                   deadline=time.monotonic() + alignment_time_limit_s)
    stats["aggregated"] = float(len(chosen))
    if len(state) != len(current):  # a job that trains a subset (fedbroker.weights): the rest stays as it was
        state = {name: state[name] if name in state else np.array(value) for name, value in current.items()}
    _check_finite(rnd, state)
    log.info("round %d: %d of %d accepted update(s) chosen by %s, %d aggregated%s", rnd.number, selection.chosen,
             selection.accepted, selection.method, len(chosen),
             f"; {rnd.algorithms.settings.robust.name} judged {len(verdicts)}" if verdicts else "")
    return Combined(chosen, weights, spec, state, stats, selection, verdicts, memory=robust.memory)


def _check_finite(rnd: Round, state: Mapping[str, np.ndarray]) -> None:
    """A global model with a NaN or infinity is never published: the close fails naming the round (the
    coordinator fails the job with it), so no site trains, and spends ε, on it."""
    bad = sorted(name for name, arr in state.items() if not np.all(np.isfinite(arr)))
    if bad:
        raise Conflict(f"round {rnd.number}'s aggregate holds NaN or infinite values (tensor {bad[0]!r}); it is not "
                       f"published as a global model and no site is asked to train on it")


def _running_result(rnd: Round, accepted: Mapping[str, Accepted],
                    stats: dict[str, float]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rows = rnd.rows
    assert rows.mean is not None
    raw = np.array([accepted[w].raw_weight for w in sorted(accepted)])
    weights, fell_back = rnd.algorithms.weighting.normalise(raw)
    stats["weighting_fallback"] = float(fell_back)
    if fell_back:
        if rows.plain_mean is None:  # only weightings whose raw weights are always > 0 skip the plain mean
            raise Conflict("every update of this round has weight zero and no unweighted mean was kept")
        log.warning("round %d: every weight is zero; falling back to the unweighted mean", rnd.number)
        return rows.plain_mean.result(), weights
    return rows.mean.result(), weights


def _choose(rnd: Round, accepted: Mapping[str, Accepted], current: Mapping[str, np.ndarray], spec: ModelSpec,
            rng: np.random.Generator, stats: dict[str, float],
            selection_time_limit_s: float, probe_sets: ProbeLoader) -> tuple[list[str], np.ndarray, SelectionRecord]:
    """Selection picks which updates enter the mean; weighting gives their coefficients."""
    selection = rnd.algorithms.selection
    vectors = selection.needs_vectors(rnd.number)
    names = list(rnd.rows.layout.shapes)
    ids = sorted(accepted)
    candidates = [
        Candidate(worker_id=w, vector=_vector(accepted[w], names) if vectors else np.zeros(0),
                  num_samples=accepted[w].num_samples, reported_loss=accepted[w].meta.loss,
                  raw_weight=accepted[w].raw_weight)
        for w in ids
    ]
    deadline = time.monotonic() + selection_time_limit_s  # loading the probe set counts against the limit
    chosen_by = selection.choose(SelectionInput(
        candidates=candidates, round_index=rnd.number,
        global_vector=_flatten(current, names) if vectors else np.zeros(0),
        rng=rng, deadline=deadline, probe=_probe(rnd, spec, probe_sets),
    ))
    if chosen_by.reason:
        log.warning("selection for round %d fell back: %s", rnd.number, chosen_by.reason)
    stats.update({f"selection_{k}": float(v) for k, v in chosen_by.stats.items()})
    chosen = list(chosen_by.chosen)
    record = chosen_by.record(method=rnd.algorithms.settings.selection.name, accepted=len(candidates))
    weights, fell_back = rnd.algorithms.weighting.normalise(np.array([accepted[w].raw_weight for w in chosen]))
    stats["weighting_fallback"] = float(fell_back)
    return chosen, weights, record


def _combine(rnd: Round, spec: ModelSpec, updates: list[Accepted], weights: np.ndarray,
             rng: np.random.Generator, stats: dict[str, float], current: Mapping[str, np.ndarray], *,
             deadline: float) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """The weighted mean, or the alignment's global network (whose widths may differ from `spec`); an
    alignment that passes `deadline` gives way to the weighted mean (in the layer-wise mode: to the mean with
    the frozen layers kept from `current`)."""
    alignment = rnd.algorithms.settings.alignment
    name = alignment.name
    if not alignment.traits.aligns_units:
        return spec, _mean(rnd, updates, weights)
    clients = [to_layers(spec, u.tensors or {}) for u in updates]
    shares = _class_shares(rnd, updates) if alignment.traits.needs_histograms else None
    try:
        result = rnd.algorithms.alignment.align(AlignInput(
            clients=clients, weights=weights, rng=rng, round_index=rnd.number, class_shares=shares, deadline=deadline,
            current=to_layers(spec, current) if alignment.params.layerwise else None,
        ))
    except DeadlinePassed as exc:
        log.warning("round %d: %s alignment stopped (%s); the round's model is the weighted mean of its %d "
                    "update(s) instead", rnd.number, name, exc, len(updates))
        stats["alignment_fallback"] = 1.0
        return spec, _kept_frozen(rnd, spec, _mean(rnd, updates, weights), current)
    stats.update({f"alignment_{k}": float(v) for k, v in result.stats.items()})
    stats["alignment_fallback"] = 0.0
    return from_layers(spec, result.layers)


def _kept_frozen(rnd: Round, spec: ModelSpec, state: dict[str, np.ndarray],
                 current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """In the layer-wise mode, the layers frozen this round are the global ones, whatever the uploads hold."""
    if not rnd.algorithms.settings.alignment.params.layerwise:
        return state
    frozen = alignment_plan(spec).frozen_in_round(rnd.number)
    return {name: np.array(current[name]) if name in frozen else value for name, value in state.items()}


@dataclass
class _RobustRun:
    """What a robust close reads besides the round (the probe sets, g_0's trainer, the job's memory) and the
    memory it leaves."""

    probe_sets: ProbeLoader
    root_trainer: RootTrainer
    memory: RobustMemory | None


def _robust(rnd: Round, updates: list[Accepted], weights: np.ndarray, current: Mapping[str, np.ndarray],
            spec: ModelSpec, rng: np.random.Generator, stats: dict[str, float],
            run: _RobustRun) -> tuple[list[str], np.ndarray, dict[str, np.ndarray], list[Verdict]]:
    """The robust rule over Δ_i = x_i − x_global of the chosen updates: (the updates it did not discard, the
    weights it gave them, the next global model, its verdict on every update). The stats get the rule's notes
    and counts of the discarded and down-weighted updates; `run.memory` becomes the rule's memory after it."""
    layout = rnd.rows.layout
    names = list(layout.shapes)
    base = _flatten(current, names).astype(np.float64)
    deltas = np.empty((len(updates), layout.size), dtype=np.float32)
    for row, update in zip(deltas, updates):
        np.subtract(_vector(update, names), base, out=row, casting="same_kind")
    rule = rnd.algorithms.robust
    request = rule.root_request()
    root = None
    if request is not None:
        x, y = run.probe_sets(request.probe.dataset, request.probe.size, request.probe.seed)
        seed = int(rng.integers(2**31))  # drawn before the rule, so its own draws (bucketing) follow it
        g0 = run.root_trainer(spec, current, x, y, epochs=request.epochs, lr=request.lr, batch_size=request.batch_size,
                          seed=seed)
        root = _flatten(g0, names)
    result = rule.aggregate(RobustInput(deltas=deltas, weights=weights, rng=rng, root_update=root,
                                        sites=tuple(u.worker_id for u in updates), memory=run.memory))
    run.memory = result.memory
    stats.update(_robust_stats(result))
    verdicts = [Verdict(u.worker_id, rnd.algorithms.settings.robust.name, float(k), float(e),
                        flagged=result.was_flagged(i))
                for i, (u, k, e) in enumerate(zip(updates, result.kept_weight, result.expected))]
    discarded = result.discarded()
    chosen = [u.worker_id for u, out in zip(updates, discarded) if not out]
    kept = result.kept_weight[~discarded]
    state = layout.views((base + result.delta).astype(np.float32))
    return chosen, kept, {name: np.asarray(t, dtype=current[name].dtype) for name, t in state.items()}, verdicts


def _robust_stats(result: RobustResult) -> dict[str, float]:
    stats = {f"robust_{k}": v for k, v in result.notes.items()}
    stats["robust_discarded"] = float(result.discarded().sum())
    stats["robust_downweighted"] = float(result.downweighted().sum())
    return stats


def _mean(rnd: Round, updates: list[Accepted], weights: np.ndarray) -> dict[str, np.ndarray]:
    """The weighted mean of the chosen updates, from the rows that hold them (one pass)."""
    assert rnd.rows.kept is not None and all(u.slot is not None for u in updates)
    return dict(weighted_mean_of_rows(rnd.rows.kept, [u.slot for u in updates if u.slot], weights, rnd.rows.layout))


def _class_shares(rnd: Round, updates: list[Accepted]) -> np.ndarray | None:
    """Each chosen worker's label counts (clients × classes), when every one of them sent a histogram."""
    rows = [rnd.histograms.get(u.worker_id) for u in updates]
    if not rows or any(not r for r in rows):
        return None
    width = max(len(r) for r in rows if r)
    return np.array([list(r or []) + [0] * (width - len(r or [])) for r in rows], dtype=np.float64)


def _probe(rnd: Round, spec: ModelSpec, probe_sets: ProbeLoader) -> Probe | None:
    """The probe set this round's selection asks for, with the job's weighting as the aggregate's coefficients."""
    request = rnd.algorithms.selection.probe_request(rnd.number)
    if request is None:
        return None
    x, y = probe_sets(request.dataset, request.size, request.seed)
    weighting = rnd.algorithms.weighting
    return Probe(spec, x, y, coefficients=lambda raw: weighting.normalise(raw)[0])


def _vector(entry: Accepted, names: list[str]) -> np.ndarray:
    """An update as one flat vector in the round's layout order: its row when it has one (no copy)."""
    return entry.slot.values if entry.slot is not None else _flatten(entry.tensors or {}, names)


def _flatten(tensors: Mapping[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.concatenate([np.ravel(tensors[n]) for n in names]) if tensors else np.zeros(0)
