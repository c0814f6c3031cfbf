"""What a site can still afford: its ledger against the coordinator's record, each job's next round against the
owner's ε budget, and the heartbeat that tells the coordinator both.

A worker never trains from a ledger that holds less ε than the coordinator recorded for it (a lost or replaced
ledger: `check_ledger`), nor a round whose steps would take its owner past the budget (`check_budget`). Its
heartbeats say what each job it knows would cost next, so the coordinator opens a round only with workers that
can afford it (coordinator/participants.py), and no worker spends ε on a round the others' refusals would fail.

A job with distributed DP is priced by its rounds' Skellam accounting (`distributed_figures`), not by Opacus steps:
the budget counts its distributed ε (the secure sum carries the quorum's noise), and the ledger keeps beside it
the local-floor ε (this site's own share alone), both recomputed from the recorded rounds.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from fedbroker.config import DPPolicy
from fedbroker.errors import BudgetExceeded, ConfigError, LedgerBehind
from fedbroker.job.spec import TrainingConfig
from fedbroker.privacy import dp_sample_rate, job_epsilon_after_round, planned_steps, project_epsilon
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.secagg import skellam
from fedbroker.worker import metrics
from fedbroker.worker.ledger import DistributedRound, PrivacyLedger, below

log = logging.getLogger(__name__)

JOB_COSTS_KEPT = 256   # jobs whose training settings a worker keeps for its heartbeats' cost reports
JOB_COSTS_REPORTED = 1024   # jobs one heartbeat lists (the coordinator takes up to 4096): the latest ledger
                            # entries; a job left out is priced by the coordinator at its first round's cost


class SiteBudget:
    """One worker's ledger seen against its owner's DP policy (`dp` None: no DP, nothing limited)."""

    def __init__(self, *, worker_id: str, ledger: PrivacyLedger, dp: DPPolicy | None, num_samples: int) -> None:
        self.worker_id = worker_id
        self.ledger = ledger
        self.dp = dp
        self.num_samples = num_samples
        # The training settings of the jobs whose tasks this worker received (the latest JOB_COSTS_KEPT), so its
        # heartbeats can say what each job's next round would cost; `_costs` caches the projections.
        self._job_configs: collections.OrderedDict[str, TrainingConfig] = collections.OrderedDict()
        self._costs: dict[tuple[str, tuple[tuple[float, float, int], ...], TrainingConfig], float] = {}
        self._out_of_budget: set[str] = set()  # jobs whose tasks it declines for its budget (said once each)
        self._distributed_jobs: set[str] = set()  # jobs with privacy.distributed among those it received

    def export(self) -> None:
        """The ε spent and the budget, as metrics (at start, and whenever the ledger changed)."""
        dp = self.dp
        metrics.set_privacy(self.worker_id, spent=self.ledger.total_epsilon(),
                            budget=dp.epsilon_budget if dp is not None else None)

    def note_job(self, job_id: str, config: TrainingConfig, *, distributed: bool = False) -> None:
        """Keep `config` as the job's training settings, for what its next round costs in the heartbeats
        (`distributed`: a distributed-DP job, priced by its rounds, not by `config`'s steps)."""
        if distributed:
            self._distributed_jobs.add(job_id)
        self._job_configs[job_id] = config
        self._job_configs.move_to_end(job_id)
        while len(self._job_configs) > JOB_COSTS_KEPT:
            self._job_configs.popitem(last=False)

    def heartbeat(self, *, state: str) -> pb.Heartbeat:
        """This worker's state and what it can still afford: the ε left of its owner's budget and, for every
        job on its ledger or whose task it received, the ε the job's next round would add."""
        spent = self.ledger.total_epsilon()
        message = pb.Heartbeat(worker_id=self.worker_id, epsilon_spent=spent, state=state)
        dp = self.dp
        if dp is None:
            return message
        message.budget_limited, message.epsilon_left = True, dp.epsilon_budget - spent
        on_ledger = list(self.ledger.jobs())[-(JOB_COSTS_REPORTED - len(self._job_configs)):]
        for job_id in sorted(set(on_ledger) | set(self._job_configs)):
            config = self._job_configs.get(job_id)
            cost = self._next_round_cost(job_id, config, dp) if config is not None else None
            message.job_costs.add(job_id=job_id, known=cost is not None, next_round_epsilon=cost or 0.0)
        return message

    def _next_round_cost(self, job_id: str, config: TrainingConfig, dp: DPPolicy) -> float | None:
        """The ε the job's next round of `config` would add to this worker's total (the check_budget projection)."""
        if job_id in self._distributed_jobs or self.ledger.distributed_rounds(job_id):
            return self._next_distributed_cost(job_id)
        history = tuple(self.ledger.history(job_id))
        key = (job_id, history, config)
        if key not in self._costs:
            try:
                after = job_epsilon_after_round(list(history), num_samples=self.num_samples, config=config,
                                                noise_multiplier=dp.noise_multiplier, delta=dp.delta)
            except ConfigError:  # no samples: nothing it could train
                return None
            if len(self._costs) > 4 * JOB_COSTS_KEPT:
                self._costs.clear()
            self._costs[key] = max(0.0, after - self.ledger.epsilon(job_id))
        return self._costs[key]

    def check_ledger(self, recorded: float) -> None:
        """Refuse to train when the ledger holds less ε than the coordinator recorded for this worker: the
        ledger was lost or replaced (its history is the coordinator's), and training from it would spend the
        owner's budget again. The worker never starts a new ledger over a history; an operator restores it."""
        total = self.ledger.total_epsilon()
        if below(total, recorded):
            raise LedgerBehind(
                f"privacy ledger {self.ledger.path} holds ε {total:.6g}, below the {recorded:.6g} the coordinator "
                f"recorded for worker {self.worker_id}: the ledger was lost or replaced; restore it (this worker "
                f"trains no more until then)")

    def check_budget(self, job_id: str, config: TrainingConfig) -> None:
        """Refuse before training if this round's steps would take the owner past its own ε budget."""
        dp = self.dp
        if dp is None:
            return
        n = self.num_samples
        projected = project_epsilon(self.ledger.history(job_id), noise_multiplier=dp.noise_multiplier,
                                    sample_rate=dp_sample_rate(n, config), steps=planned_steps(n, config),
                                    delta=dp.delta)
        others = self.ledger.total_epsilon() - self.ledger.epsilon(job_id)
        metrics.set_next_round_cost(self.worker_id, epsilon=projected - self.ledger.epsilon(job_id))
        if projected + others > dp.epsilon_budget:
            if job_id not in self._out_of_budget:  # once per job: every later task is declined for the same reason
                self._out_of_budget.add(job_id)
                log.warning("worker %s: privacy budget spent for job %s: the owner's budget is ε %g (worker.dp."
                            "epsilon_budget), ε %.3f is spent and a round of this job costs ε %.3f: it declines the "
                            "job's tasks (raise the budget to take part)", self.worker_id, job_id, dp.epsilon_budget,
                            self.ledger.total_epsilon(), projected - self.ledger.epsilon(job_id))
            raise BudgetExceeded(
                f"privacy budget exceeded: this round would bring ε to {projected + others:.3f} "
                f"(job {projected:.3f} + other jobs {others:.3f}), above the owner's budget {dp.epsilon_budget:g}"
            )

    def _next_distributed_cost(self, job_id: str) -> float | None:
        """A distributed-DP job's next round, priced as its last one again (None before its first round: the
        round's settings are fixed only with its roster)."""
        rounds = self.ledger.distributed_rounds(job_id)
        if not rounds:
            return None
        return max(0.0, distributed_figures([*rounds, rounds[-1]])[0] - self.ledger.epsilon(job_id))

    def check_distributed(self, job_id: str, step: DistributedRound) -> tuple[float, float]:
        """Refuse before a distributed-DP round (no key sent yet) if its distributed ε would take the owner past its
        budget; else (distributed ε, local-floor ε) of the job after the round."""
        dp = self.dp
        if dp is None:
            raise BudgetExceeded(f"job {job_id} runs distributed DP but this site's DP is off")
        distributed, floor = distributed_figures([*self.ledger.distributed_rounds(job_id), step])
        others = self.ledger.total_epsilon() - self.ledger.epsilon(job_id)
        metrics.set_next_round_cost(self.worker_id, epsilon=distributed - self.ledger.epsilon(job_id))
        if distributed + others > dp.epsilon_budget:
            raise BudgetExceeded(
                f"privacy budget exceeded: this distributed-DP round would bring ε to {distributed + others:.3f} "
                f"(job {distributed:.3f} + other jobs {others:.3f}), above the owner's budget {dp.epsilon_budget:g}")
        return distributed, floor


def skellam_round(step: DistributedRound) -> skellam.DDPRound:
    """The accountant's view of a recorded round (what its ε depends on: γ, d, C, z, q and the quorum)."""
    full = (step.scale * step.noise_multiplier * step.clip) ** 2
    return skellam.DDPRound(scale=step.scale, share_variance=full / step.quorum, full_variance=full, bits=step.bits,
                            wrap_probability=0.0, quorum=step.quorum, dim=step.dim, clip=step.clip,
                            noise_multiplier=step.noise_multiplier, sample_rate=step.sample_rate)


def distributed_variance(step: DistributedRound) -> float:
    """The noise the sum of a quorum carries, as the job's ε counts it (docs/privacy.md): at least the whole dose
    μ = (γzC)² of n_min shares, and never less than this site's own share (a `local`-mode site adds μ itself)."""
    return max(skellam_round(step).full_variance, step.mu)


def distributed_figures(rounds: list[DistributedRound]) -> tuple[float, float]:
    """(distributed ε, local-floor ε) of a job's rounds on this site, composed by adding their RDP curves and
    converted at the last round's δ: the first with the quorum's noise, the second with this site's share alone."""
    if not rounds:
        return 0.0, 0.0
    together = sum((skellam.round_rdp(round=skellam_round(r), variance=distributed_variance(r)) for r in rounds),
                   start=np.zeros(len(skellam.ORDERS)))
    alone = sum((skellam.round_rdp(round=skellam_round(r), variance=r.mu) for r in rounds),
                start=np.zeros(len(skellam.ORDERS)))
    delta = rounds[-1].delta
    return (skellam.rdp_to_epsilon(skellam.ORDERS, together, delta=delta)[0],
            skellam.rdp_to_epsilon(skellam.ORDERS, alone, delta=delta)[0])
