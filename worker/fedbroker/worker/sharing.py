"""What a site shares about its data beyond its updates, and only with a job that asks (a ShareRequest before
round 1): its label histogram (for algorithms that need class shares: DWFed, PFNM/NAFI) and per-feature
sums and sums of squares (for statistics the sites agree on, `data.standardize: federated`). Registration
carries neither: a FedAvg job learns no class count and the site spends no ε on one.

Each release is noised by default and charged to the ledger once: the histogram with Laplace noise at
`worker.histogram_epsilon` (pure ε-DP), the statistics with the Gaussian mechanism at
`worker.statistics_epsilon` and the δ of the site's DP policy (`STATISTICS_DELTA_WITHOUT_DP` when its DP
is off). ε 0 releases exact values, by the owner's explicit choice. A draw is kept in the ledger with what it
was drawn from and re-sent to every later request at no new cost (fresh draws would let a coordinator
average the noise away); a changed data set, ε, δ or clipping range draws (and pays for) a new one, refused
if it would pass the owner's budget.

A reply shares all it was asked or nothing: a request this site refuses (its `data.standardize` policy, its
budget, a clipping range that does not fit its features, a category it does not serve) gets
`refused=true` and a reason naming the setting, and no release is drawn for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence

import numpy as np

from fedbroker.config import DPPolicy
from fedbroker.errors import BudgetExceeded, ConfigError, ConfigErrors, TaskRefused
from fedbroker.job.spec import ModelSpec
from fedbroker.label_stats import noisy_histogram
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.statistics_release import MIN_STATISTICS_DELTA, MIN_STATISTICS_EPSILON
from fedbroker.worker.feature_statistics import (
    BadBounds,
    StatisticsDraw,
    clipped_sums,
    feature_bounds,
    release_statistics,
)
from fedbroker.worker.ledger import PrivacyLedger, source_digest

log = logging.getLogger(__name__)

HISTOGRAM_RELEASE = "label_histogram"        # the ledger's name for the noised label histogram
STATISTICS_RELEASE = "feature_statistics"    # + ":" + the digest of the clipping range
STATISTICS_DELTA_WITHOUT_DP = 1e-5           # the statistics' δ on a site whose DP is off (no policy δ)
STANDARDIZE_LAYER = "standardize"            # the model spec's layer type (fedbroker.layers)


class ShareRefused(TaskRefused):
    """This site will not share what a job asks (or train its model): the reason names the setting."""

    reason = "task_refused"


class Sharing:
    """One site's releases about its training rows (`x`, `y`), under its owner's settings and ledger."""

    def __init__(self, *, worker_id: str, categories: Sequence[str], ledger: PrivacyLedger, dp: DPPolicy | None,
                 histogram_epsilon: float, statistics_epsilon: float, standardize: str, x: np.ndarray,
                 y: np.ndarray, num_classes: int, rng: np.random.Generator | None = None) -> None:
        """`rng`: the noise's generator; None draws from the operating system (tests pass a seeded one)."""
        problems = [ConfigError(f"worker.{name}", f"must be a finite number >= 0 (0 = exact), got {value!r}")
                    for name, value in (("histogram_epsilon", histogram_epsilon),
                                        ("statistics_epsilon", statistics_epsilon))
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf")]
        valid = not any(p.field == "worker.statistics_epsilon" for p in problems)
        if valid and 0 < statistics_epsilon < MIN_STATISTICS_EPSILON:  # the coordinator would leave it out
            problems.append(ConfigError("worker.statistics_epsilon", f"must be 0 (exact) or at least "
                                        f"{MIN_STATISTICS_EPSILON:g}, got {statistics_epsilon!r}: a coordinator takes "
                                        f"no statistics noised more widely (they could hide any sums)"))
        shares = valid and statistics_epsilon and standardize != "site"
        if shares and dp is not None and dp.delta < MIN_STATISTICS_DELTA:
            problems.append(ConfigError("worker.dp.delta", f"is {dp.delta:g}, below {MIN_STATISTICS_DELTA:g}: a "
                                        f"coordinator takes no statistics noised at so small a δ (set "
                                        f"worker.statistics_epsilon 0 for exact ones, or raise δ)"))
        if problems:
            raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
        self.worker_id, self.categories, self.ledger, self.dp = worker_id, tuple(categories), ledger, dp
        self.histogram_epsilon, self.statistics_epsilon = float(histogram_epsilon), float(statistics_epsilon)
        self.standardize = standardize
        self.x, self.num_classes = x, num_classes
        self.exact_histogram = np.bincount(y, minlength=num_classes)
        self.rng = rng if rng is not None else np.random.default_rng()

    @property
    def statistics_delta(self) -> float:
        """The δ of a statistics release: the site's DP policy's, or STATISTICS_DELTA_WITHOUT_DP without one."""
        return self.dp.delta if self.dp is not None else STATISTICS_DELTA_WITHOUT_DP

    def summary(self) -> str:
        """One line of what this site will share, and how, for its log at start."""
        shape = [int(d) for d in self.x.shape[1:]]
        histogram = (f"noised (Laplace, ε {self.histogram_epsilon:g})" if self.histogram_epsilon
                     else "exact counts (worker.histogram_epsilon 0)")
        if self.standardize == "site":
            statistics = "never (data.standardize: site)"
        elif self.statistics_epsilon:
            statistics = (f"noised (Gaussian, ε {self.statistics_epsilon:g}, δ {self.statistics_delta:g}"
                          f"{'; DP is off here, so δ is fixed' if self.dp is None else ''})")
        else:
            statistics = "exact (worker.statistics_epsilon 0)"
        dp = self.dp
        policy = (f"DP-SGD noise {dp.noise_multiplier:g}, clip {dp.max_grad_norm:g}, δ {dp.delta:g}, ε budget "
                  f"{dp.epsilon_budget:g} ({self.ledger.total_epsilon():.4g} spent)" if dp is not None else "DP off")
        return (f"worker {self.worker_id} registers {len(self.x)} training samples of shape {shape}, "
                f"{self.num_classes} classes; shares on a job's request only: label histogram {histogram}, "
                f"feature statistics {statistics}; data.standardize {self.standardize}; {policy}")

    # ----- the releases -----

    def histogram(self) -> tuple[np.ndarray, float]:
        """The released label histogram and the ε of its draw (0: exact); drawn and charged on first use."""
        epsilon = self.histogram_epsilon
        if not epsilon:
            return self.exact_histogram, 0.0
        source = [int(c) for c in self.exact_histogram]
        kept = self.ledger.release(HISTOGRAM_RELEASE)
        if (kept is not None and kept.draw_epsilon == epsilon and len(kept.value) == len(source)
                and kept.source_sha256 == source_digest(source)):
            return np.asarray(kept.value, dtype=np.int64), epsilon
        self._afford(epsilon, "worker.histogram_epsilon", "the label histogram")
        released = noisy_histogram(self.exact_histogram, epsilon=epsilon, rng=self.rng)
        self.ledger.record_release(HISTOGRAM_RELEASE, value=[int(c) for c in released], epsilon=epsilon, source=source)
        log.info("worker %s released its label histogram at ε %g (charged to its ledger)", self.worker_id, epsilon)
        return released, epsilon

    def statistics(self, lower: np.ndarray, upper: np.ndarray) -> StatisticsDraw:
        """The released sums and sums of squares for this clipping range (feature_statistics); drawn and
        charged on first use, then kept for the same range, data, ε and δ."""
        exact = clipped_sums(self.x, lower, upper)
        epsilon, delta = self.statistics_epsilon, self.statistics_delta
        if not epsilon:
            return release_statistics(exact, epsilon=0.0, delta=0.0, rng=self.rng)
        name, source = self._statistics_key(lower, upper, exact)
        kept = self.ledger.release(name)
        d = len(exact) // 2
        if (kept is not None and kept.draw_epsilon == epsilon and kept.delta == delta and len(kept.value) == 2 * d
                and kept.source_sha256 == source_digest(source)):
            value = np.asarray(kept.value, dtype=np.float64)
            return StatisticsDraw(value[:d], value[d:], epsilon, delta)
        self._afford(epsilon, "worker.statistics_epsilon", "the feature statistics")
        draw = release_statistics(exact, epsilon=epsilon, delta=delta, rng=self.rng)
        self.ledger.record_release(name, value=[float(v) for v in np.concatenate([draw.sums, draw.sq_sums])],
                                   epsilon=epsilon, delta=delta, source=source)
        log.info("worker %s released feature statistics at ε %g, δ %g (charged to its ledger)", self.worker_id,
                 epsilon, delta)
        return draw

    def _statistics_key(self, lower: np.ndarray, upper: np.ndarray, exact: np.ndarray) -> tuple[str, list[float]]:
        """The ledger name of the release for this range, and what it is drawn from (the exact sums, which
        change with the data and the range)."""
        bounds = json.dumps([[float(v) for v in lower], [float(v) for v in upper]]).encode()
        return f"{STATISTICS_RELEASE}:{hashlib.sha256(bounds).hexdigest()[:16]}", [float(v) for v in exact]

    def _new_cost(self, request: pb.ShareRequest, bounds: tuple[np.ndarray, np.ndarray] | None) -> float:
        """The ε the request's releases would newly charge (a kept draw costs nothing)."""
        cost = 0.0
        if request.histogram and self.histogram_epsilon:
            kept = self.ledger.release(HISTOGRAM_RELEASE)
            source = source_digest([int(c) for c in self.exact_histogram])
            if kept is None or kept.draw_epsilon != self.histogram_epsilon or kept.source_sha256 != source:
                cost += self.histogram_epsilon
        if bounds is not None and self.statistics_epsilon:
            name, source_values = self._statistics_key(*bounds, clipped_sums(self.x, *bounds))
            kept = self.ledger.release(name)
            if (kept is None or kept.draw_epsilon != self.statistics_epsilon or kept.delta != self.statistics_delta
                    or kept.source_sha256 != source_digest(source_values)):
                cost += self.statistics_epsilon
        return cost

    def _afford(self, epsilon: float, setting: str, what: str) -> None:
        dp = self.dp
        total = self.ledger.total_epsilon()
        if dp is not None and total + epsilon > dp.epsilon_budget:
            raise BudgetExceeded(f"{setting}: releasing {what} at ε {epsilon:g} would bring ε to {total + epsilon:.4g}, "
                                 f"above the owner's budget worker.dp.epsilon_budget {dp.epsilon_budget:g}")

    # ----- a job's request -----

    def reply(self, request: pb.ShareRequest) -> pb.ShareReply:
        """The answer to a job's request: everything it asked for, or refused with the reason (module doc)."""
        try:
            return self._share(request)
        except (TaskRefused, BadBounds) as exc:
            log.warning("worker %s refuses to share with job %s: %s", self.worker_id, request.job_id, exc)
            return pb.ShareReply(job_id=request.job_id, worker_id=self.worker_id, refused=True, reason=str(exc))

    def _share(self, request: pb.ShareRequest) -> pb.ShareReply:
        if request.category not in self.categories:
            raise ShareRefused(f"category {request.category!r} is not one this worker serves "
                               f"({list(self.categories)}: worker.categories)")
        bounds = None
        if request.feature_statistics:
            if self.standardize == "site":
                raise ShareRefused("worker.data.standardize is 'site': this site z-scores its data with its own mean "
                                   "and std and takes no part in statistics the sites agree on (set it to "
                                   "'federated' to join such jobs)")
            bounds = feature_bounds(request.lower, request.upper, int(np.prod(self.x.shape[1:])))
        cost = self._new_cost(request, bounds)
        if cost:  # all or nothing: no release is drawn for a request the budget cannot pay in full
            self._afford(cost, "worker.histogram_epsilon/statistics_epsilon", "what the job asks")
        reply = pb.ShareReply(job_id=request.job_id, worker_id=self.worker_id)
        if request.histogram:
            counts, epsilon = self.histogram()
            reply.label_histogram.extend(int(c) for c in counts)
            reply.histogram_noised, reply.histogram_epsilon = bool(epsilon), epsilon
        if bounds is not None:
            draw = self.statistics(*bounds)
            reply.feature_sum.extend(float(v) for v in draw.sums)
            reply.feature_sq_sum.extend(float(v) for v in draw.sq_sums)
            reply.count = len(self.x)
            reply.statistics_noised = bool(draw.epsilon)
            reply.statistics_epsilon, reply.statistics_delta = draw.epsilon, draw.delta
        return reply

    def note_sent(self, reply: pb.ShareReply) -> None:
        """Log in the ledger what a sent reply shared, at the ε of each draw (nothing for a refusal)."""
        if reply.refused:
            return
        if len(reply.label_histogram):
            self.ledger.note_shared(reply.job_id, "histogram", epsilon=reply.histogram_epsilon)
        if len(reply.feature_sum):
            self.ledger.note_shared(reply.job_id, "statistics", epsilon=reply.statistics_epsilon)

    def check_model(self, spec: ModelSpec) -> None:
        """Refuse a model whose input preprocessing contradicts `worker.data.standardize` before training."""
        first = spec.nodes[0].type if spec.nodes else ""  # a chain's first layer; a graph's first node reads the input
        if self.standardize == "site" and first == STANDARDIZE_LAYER:
            raise ShareRefused("worker.data.standardize is 'site': this site's data is z-scored with its own mean and "
                               "std, and the job's model standardises its input again (its first layer is "
                               "standardize); set it to 'federated' to train such models")
        if self.standardize == "federated" and first != STANDARDIZE_LAYER:
            raise ShareRefused(f"worker.data.standardize is 'federated': this site's data is raw and it trains only "
                               f"models whose first layer standardizes their input; this job's model starts with "
                               f"{first or 'nothing'}")
