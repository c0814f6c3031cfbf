"""What the coordinator accepts on its control queue: registrations, heartbeats, task outcomes, share replies
and evaluation reports, checked before any of them reaches the store (a share reply is checked again against
what its job asked: coordinator/sharing.py; an evaluation report against the task it answers: federated.py).

Anyone with the broker's credentials can publish there, so a message is input like a job: a worker id must
be a name the bus can route to (a stored id it cannot route would fail the job that selects it), and every
count and number is bounded. A message that fails is dead-lettered with a reason
(`fedbroker_coordinator_control_messages_rejected_total{reason}`), never stored, and never reaches a job.

Each message is bound to its sender (`SenderBinding`): RabbitMQ validates every message's `user_id` against
the publishing connection's user, and a deployment that gives each site its own broker user
(`coordinator.worker_broker_users`, written by `fedbroker provision`) has a message refused unless its user
may speak for its worker id (deploy/SECURITY.md).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fedbroker.bus.base import check_name
from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError, FedbrokerError
from fedbroker.job.spec import MAX_WIDTH
from fedbroker.job.status import WorkerState
from fedbroker.proto import fedbroker_pb2 as pb

MAX_CATEGORIES = 64
MAX_CLASSES = MAX_WIDTH            # a label histogram has a count per output of the widest layer, at most
MAX_SAMPLES = 1_000_000_000        # a worker's data set, and any one count of its histogram
MAX_SAMPLE_DIMS = 8                # the sizes in one sample's shape (a model takes 1 to 3)
MAX_REASON_CHARS = 2000            # a worker's free-text reason is kept, cut to this length
MAX_JOB_COSTS = 4096               # jobs one heartbeat may price (a worker's ledger and recent tasks)
MAX_FEATURES = 1 << 20             # values in a share reply's feature sums (a model's flattened input, at most)
MAX_SUM = 1e15                     # any one noised sum: far beyond any real sum of values in [0, 1]
MAX_EVALUATION_SUMS = 1 << 17       # named sums in one evaluation report: 1000-bin histograms of ~60 labels
_CATEGORY = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")   # a job's `category` (fedbroker.job.spec)
_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")     # cpu, cuda, cuda:1, mps
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")     # a job's name, '-' and 8 hex digits
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._+()-]{0,63}")   # 0.1.0, 1.2.0rc1+local, unknown (not installed)
LOG_LEVELS = ("WARNING", "ERROR", "CRITICAL")  # what a site forwards of its log (worker/log_forward.py)
MAX_LOG_MESSAGE_CHARS = 4000       # a site log's text; the store keeps less (a worker sends less still)
MAX_LOGGER_CHARS = 200

# The rejection reasons of the control queue's messages (metric label values).
INVALID_REASONS = {"registration": "invalid_registration", "heartbeat": "invalid_heartbeat",
                   "task_outcome": "invalid_task_outcome", "share_reply": "invalid_share_reply",
                   "evaluation_report": "invalid_evaluation_report", "site_log": "invalid_site_log"}
# ... and those of a message whose sender may not speak for its worker id (SenderBinding).
SENDER_REASONS = ("unidentified_sender", "foreign_sender")

log = logging.getLogger(__name__)


class InvalidControlMessage(FedbrokerError):
    """A control message that decoded but is not one a worker may send; `reason` names its kind."""

    def __init__(self, kind: str, problems: list[str]) -> None:
        self.reason = INVALID_REASONS[kind]
        super().__init__(f"{kind} refused: {'; '.join(problems)}")


class ForeignSender(FedbrokerError):
    """A control message whose broker user may not speak for its worker id; `reason` is a SENDER_REASONS value."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class SenderBinding:
    """Which broker users may speak for which worker ids on the control queue (`users`: user → worker ids).

    Empty: nothing is checked, and the constructor logs what that allows. Otherwise a message is refused
    unless its sender (its broker-validated user_id, `Delivery.sender`) is mapped to its worker id: a
    message without a user_id as `unidentified_sender`, one from a user not mapped to it as `foreign_sender`."""

    def __init__(self, users: Mapping[str, Sequence[str]], *, shared_broker: bool = True,
                 follow: Callable[[], Mapping[str, Sequence[str]]] | None = None) -> None:
        """`shared_broker`: the bus has broker users to tell apart (RabbitMQ); on the in-process bus, where every
        sender is this process, an unbound control queue is no risk and is only noted at INFO. `follow`: the
        map as it is now (the coordinator's config file, followed while it runs: a site `fedbroker provision
        add` binds is accepted without a restart); asked on every check, parsed again when it returns another
        mapping than before. A mapping it returns must hold valid worker ids (its loader checks them)."""
        self._follow = follow
        self._users = users
        # called with the worker ids a changed map no longer binds to any user (a site revoked while running)
        self.on_unbound: Callable[[list[str]], None] | None = None
        self._workers = self._parse(users)
        if not self._workers:
            log.log(logging.WARNING if shared_broker else logging.INFO, "control messages are not bound to their senders (coordinator.worker_broker_users is "
                        "empty): whoever holds the broker's credentials may register, beat and report for any "
                        "worker id (deploy/SECURITY.md)")

    @staticmethod
    def _parse(users: Mapping[str, Sequence[str]]) -> dict[str, frozenset[str]]:
        workers: dict[str, frozenset[str]] = {}
        for user, worker_ids in users.items():
            for worker_id in worker_ids:  # a ConfigError naming the setting, at start
                check_name(f"coordinator.worker_broker_users.{user}", worker_id)
            workers[user] = frozenset(worker_ids)
        return workers

    def _current(self) -> dict[str, frozenset[str]]:
        """The map in force: the followed one as it is now, else the one given at start."""
        if self._follow is not None:
            users = self._follow()
            if users is not self._users:
                before = self._workers
                self._workers, self._users = self._parse(users), users   # one assignment each: a check sees either
                unbound = _bound(before) - _bound(self._workers)
                if unbound and self.on_unbound is not None:
                    self.on_unbound(sorted(unbound))
        return self._workers

    @property
    def enabled(self) -> bool:
        """Whether senders are checked at all."""
        return bool(self._current())

    def check(self, env: pb.Envelope, sender: str | None) -> None:
        """Raise `ForeignSender` when the message's sender may not speak for the worker id it names."""
        workers = self._current()
        if not workers:
            return
        kind = env.WhichOneof("message")
        if kind not in INVALID_REASONS or kind == "site_log":  # a site log is filed under its sender (`site_for`)
            return
        worker_id = str(getattr(env, kind).worker_id)
        if not sender:
            raise ForeignSender("unidentified_sender", f"{kind} for worker {worker_id!r} refused: it carries no "
                                                       f"user_id, so nothing binds it to a broker user")
        if worker_id not in workers.get(sender, frozenset()):
            raise ForeignSender("foreign_sender", f"{kind} for worker {worker_id!r} refused: broker user "
                                                  f"{sender[:140]!r} may not speak for it")


    def site_for(self, sender: str | None, claimed: str) -> str | None:
        """The site a message from `sender` is about, whatever worker id it claims: unchecked, the claim (as for
        every control message); else the claim when the sender may speak for it, or the one worker the sender
        speaks for; None when the sender speaks for none (or for several, none of them the one claimed)."""
        workers = self._current()
        if not workers:
            return claimed
        mine = workers.get(sender or "", frozenset())
        if claimed in mine:
            return claimed
        return next(iter(mine)) if len(mine) == 1 else None

    def provisioned(self) -> frozenset[str]:
        """Every worker id some broker user may speak for (empty: nothing is checked)."""
        return _bound(self._current())


def _bound(workers: Mapping[str, frozenset[str]]) -> frozenset[str]:
    return frozenset().union(*workers.values()) if workers else frozenset()


def check_control(env: pb.Envelope) -> None:
    """Raise `InvalidControlMessage` naming every problem of a decoded registration, heartbeat or outcome."""
    kind = env.WhichOneof("message") or ""
    check = _CHECKS.get(kind)
    if check is None:
        return
    problems = check(getattr(env, kind))
    if problems:
        raise InvalidControlMessage(kind, problems)


def _worker_id_problems(worker_id: str) -> list[str]:
    try:
        check_name("worker_id", worker_id)
    except ConfigError as exc:
        return [str(exc)]
    return []


def _epsilon_problems(field: str, value: float) -> list[str]:
    return [] if math.isfinite(value) and value >= 0 else [f"{field}: must be a finite number >= 0, got {value!r}"]


def _size_ok(axis: int, size: int, rank: int) -> bool:
    """One size of a registered sample shape: 1 to MAX_WIDTH, or 0 (files of differing sizes) for a spatial axis
    of an image or volume, never for its channels."""
    return 1 <= size <= MAX_WIDTH or (size == 0 and rank in (3, 4) and axis > 0)


def _registration_problems(r: pb.Registration) -> list[str]:
    out = _worker_id_problems(r.worker_id)
    if not 1 <= len(r.categories) <= MAX_CATEGORIES:
        out.append(f"categories: must list 1 to {MAX_CATEGORIES} categories, got {len(r.categories)}")
    out += [f"categories[{i}]: must be 1-128 letters, digits, '_', '.' or '-' starting with a letter or digit, "
            f"got {c[:140]!r}" for i, c in enumerate(r.categories[:MAX_CATEGORIES]) if not _CATEGORY.fullmatch(c)]
    if len(r.label_histogram) > MAX_CLASSES:
        out.append(f"label_histogram: at most {MAX_CLASSES} classes, got {len(r.label_histogram)}")
    elif any(not 0 <= c <= MAX_SAMPLES for c in r.label_histogram):
        out.append(f"label_histogram: every count must lie in [0, {MAX_SAMPLES}]")
    if not 1 <= r.num_samples <= MAX_SAMPLES:
        out.append(f"num_samples: must lie in [1, {MAX_SAMPLES}], got {r.num_samples}")
    if not 0 <= r.evaluation_samples <= MAX_SAMPLES:
        out.append(f"evaluation_samples: must lie in [0, {MAX_SAMPLES}], got {r.evaluation_samples}")
    if len(r.input_shape) > MAX_SAMPLE_DIMS or any(not _size_ok(i, d, len(r.input_shape))
                                                   for i, d in enumerate(r.input_shape)):
        out.append(f"input_shape: at most {MAX_SAMPLE_DIMS} sizes in [1, {MAX_WIDTH}] (0 for a spatial size of an "
                   f"image (C, H, W) or volume (C, D, H, W) whose files differ), got {list(r.input_shape)[:16]}")
    if not 0 <= r.num_classes <= MAX_CLASSES:
        out.append(f"num_classes: must lie in [0, {MAX_CLASSES}], got {r.num_classes}")
    elif r.num_classes and r.label_histogram and len(r.label_histogram) != r.num_classes:
        out.append(f"num_classes: is {r.num_classes} but label_histogram has {len(r.label_histogram)} counts")
    out += _epsilon_problems("epsilon_spent", r.epsilon_spent)
    if r.software_version and not _VERSION.fullmatch(r.software_version):
        out.append(f"software_version: must be 1-64 letters, digits, spaces or '._+()-', got {r.software_version[:80]!r}")
    out += _epsilon_problems("started_unix", r.started_unix)
    if not _DEVICE.fullmatch(r.device):
        out.append(f"device: must be 1-64 letters, digits, '_', '.', ':' or '-', got {r.device[:80]!r}")
    if r.dp_enabled:
        p = r.dp_policy
        numbers = (p.noise_multiplier, p.max_grad_norm, p.delta, p.epsilon_budget, p.local_floor_epsilon)
        if not all(math.isfinite(x) for x in numbers):
            out.append(f"dp_policy: every number must be finite, got {list(numbers)}")
        else:  # mode "": a worker from before dp.mode, which takes part as `local`
            policy = DPPolicy(enabled=False, noise_multiplier=p.noise_multiplier, max_grad_norm=p.max_grad_norm,
                              delta=p.delta, epsilon_budget=p.epsilon_budget, mode=p.mode or "local",
                              local_floor_epsilon=p.local_floor_epsilon)
            out += [str(e) for e in policy.problems()]
    return out


def _heartbeat_problems(h: pb.Heartbeat) -> list[str]:
    out = _worker_id_problems(h.worker_id) + _epsilon_problems("epsilon_spent", h.epsilon_spent)
    if h.state not in set(WorkerState):
        out.append(f"state: must be one of {', '.join(sorted(WorkerState))}, got {h.state[:40]!r}")
    # what it can afford decides whether a round opens with it (participants.why_unaffordable): a NaN would
    # compare as affordable
    if not math.isfinite(h.epsilon_left):
        out.append(f"epsilon_left: must be a finite number, got {h.epsilon_left!r}")
    if len(h.job_costs) > MAX_JOB_COSTS:
        out.append(f"job_costs: at most {MAX_JOB_COSTS} jobs, got {len(h.job_costs)}")
    else:
        out += [f"job_costs[{i}].job_id: must be a job id, got {c.job_id[:140]!r}"
                for i, c in enumerate(h.job_costs) if not _JOB_ID.fullmatch(c.job_id)]
        out += _epsilon_problems("job_costs[].next_round_epsilon", next(
            (c.next_round_epsilon for c in h.job_costs
             if not (math.isfinite(c.next_round_epsilon) and c.next_round_epsilon >= 0)), 0.0))
    return out


def _outcome_problems(o: pb.TaskOutcome) -> list[str]:
    out = _worker_id_problems(o.worker_id)
    if not _JOB_ID.fullmatch(o.job_id):
        out.append(f"job_id: not a job id, got {o.job_id[:140]!r}")
    if o.round < 1:
        out.append(f"round: must be >= 1, got {o.round}")
    if o.status not in (pb.TaskOutcome.REFUSED, pb.TaskOutcome.FAILED, pb.TaskOutcome.UPLOADED):
        out.append(f"status: must be REFUSED, FAILED or UPLOADED, got {o.status}")
    out += _epsilon_problems("epsilon", o.epsilon)
    out += _epsilon_problems("epsilon_local_floor", o.epsilon_local_floor)
    if not 0 <= o.num_samples <= MAX_SAMPLES:
        out.append(f"num_samples: must lie in [0, {MAX_SAMPLES}], got {o.num_samples}")
    return out


def _share_reply_problems(r: pb.ShareReply) -> list[str]:
    """What a share reply may hold whatever its job asked (sharing.reply_problems checks it against that)."""
    out = _worker_id_problems(r.worker_id)
    if not _JOB_ID.fullmatch(r.job_id):
        out.append(f"job_id: not a job id, got {r.job_id[:140]!r}")
    if r.refused and (r.label_histogram or r.feature_sum or r.feature_sq_sum or r.count):
        out.append("refused: a refusal shares nothing, but this one holds a histogram or statistics")
    if len(r.label_histogram) > MAX_CLASSES:
        out.append(f"label_histogram: at most {MAX_CLASSES} classes, got {len(r.label_histogram)}")
    elif any(not 0 <= c <= MAX_SAMPLES for c in r.label_histogram):
        out.append(f"label_histogram: every count must lie in [0, {MAX_SAMPLES}]")
    out += _epsilon_problems("histogram_epsilon", r.histogram_epsilon)
    out += _epsilon_problems("statistics_epsilon", r.statistics_epsilon)
    if not (math.isfinite(r.statistics_delta) and 0 <= r.statistics_delta < 1):
        out.append(f"statistics_delta: must lie in [0, 1), got {r.statistics_delta!r}")
    if r.label_histogram and r.histogram_noised != (r.histogram_epsilon > 0):
        out.append(f"histogram_noised: is {r.histogram_noised} but histogram_epsilon is {r.histogram_epsilon!r} "
                   f"(noised releases state their ε > 0; exact ones 0)")
    if r.count and r.statistics_noised != (r.statistics_epsilon > 0):
        out.append(f"statistics_noised: is {r.statistics_noised} but statistics_epsilon is {r.statistics_epsilon!r}")
    if len(r.feature_sum) > MAX_FEATURES or len(r.feature_sq_sum) != len(r.feature_sum):
        out.append(f"feature_sum, feature_sq_sum: must hold as many values, at most {MAX_FEATURES}, got "
                   f"{len(r.feature_sum)} and {len(r.feature_sq_sum)}")
    elif not all(math.isfinite(v) and abs(v) <= MAX_SUM for v in (*r.feature_sum, *r.feature_sq_sum)):
        out.append(f"feature_sum, feature_sq_sum: every value must be finite and within ±{MAX_SUM:g}")
    if not 0 <= r.count <= MAX_SAMPLES:
        out.append(f"count: must lie in [0, {MAX_SAMPLES}], got {r.count}")
    elif bool(r.count) != bool(r.feature_sum):
        out.append(f"count: is {r.count} with {len(r.feature_sum)} feature sums (statistics hold both, or neither)")
    return out


def _evaluation_problems(r: pb.EvaluationReport) -> list[str]:
    """A score is a weighted vote in the round's federated accuracy: finite, in range, and a count that could
    be a held-out split (its bound against the worker's registration: coordinator/federated.py)."""
    out = _worker_id_problems(r.worker_id)
    if not _JOB_ID.fullmatch(r.job_id):
        out.append(f"job_id: not a job id, got {r.job_id[:140]!r}")
    if r.round < 1 or r.model_version < 1:
        out.append(f"round and model_version: must be >= 1, got {r.round} and {r.model_version}")
    if not r.refused:
        if not (math.isfinite(r.loss) and r.loss >= 0):
            out.append(f"loss: must be a finite number >= 0, got {r.loss!r}")
        if not (0.0 <= r.accuracy <= 1.0 or (r.sums and math.isfinite(r.accuracy) and r.accuracy >= 0)):
            # NaN fails too; a report with sums may carry an error (MAE) as its headline, which the
            # coordinator recomputes from the sums anyway
            out.append(f"accuracy: must lie in [0, 1] (or be a finite error >= 0 with sums), got {r.accuracy!r}")
        if len(r.sums) > MAX_EVALUATION_SUMS:
            out.append(f"sums: at most {MAX_EVALUATION_SUMS} named sums, got {len(r.sums)} from worker "
                       f"{r.worker_id[:140]!r}")
        elif not all(len(k) <= 32 and math.isfinite(v) and abs(v) <= MAX_SUM for k, v in r.sums.items()):
            out.append(f"sums: every name at most 32 characters, every value finite and within ±{MAX_SUM:g}")
        if not 1 <= r.num_samples <= MAX_SAMPLES:
            out.append(f"num_samples: must lie in [1, {MAX_SAMPLES}], got {r.num_samples}")
    return out


def _site_log_problems(r: pb.SiteLog) -> list[str]:
    """A site's log record: a level it may forward and bounded text (control characters are the store's to strip:
    fedbroker.printable). The worker id is only a claim (SenderBinding.site_for), but it must be a name."""
    out = _worker_id_problems(r.worker_id)
    if r.level not in LOG_LEVELS:
        out.append(f"level: must be one of {', '.join(LOG_LEVELS)}, got {r.level[:20]!r}")
    if len(r.message) > MAX_LOG_MESSAGE_CHARS or len(r.logger) > MAX_LOGGER_CHARS:
        out.append(f"message, logger: at most {MAX_LOG_MESSAGE_CHARS} and {MAX_LOGGER_CHARS} characters, got "
                   f"{len(r.message)} and {len(r.logger)}")
    out += _epsilon_problems("time_unix", r.time_unix)
    if r.dropped_before < 0:
        out.append(f"dropped_before: must be >= 0, got {r.dropped_before}")
    return out


# check_control's checks, by the Envelope field each reads (a kind not named here is not checked).
_CHECKS: dict[str, Callable[[Any], list[str]]] = {
    "registration": _registration_problems,
    "heartbeat": _heartbeat_problems,
    "task_outcome": _outcome_problems,
    "share_reply": _share_reply_problems,
    "evaluation_report": _evaluation_problems,
    "site_log": _site_log_problems,
}
