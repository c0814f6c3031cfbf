"""One secure round's settings and timing, shared by the coordinator, the aggregation service and the workers.

The crypto is `fedbroker.secagg` (SecAgg+); this module only fixes what every party must agree on for a
round of n participants: the ring, the clip range and the threshold (`round_params`), and how long each
phase may wait. The settings follow from n alone, so the coordinator (how many uploads a round needs), the
service (the round's session) and the job's view (`describe`) compute the same ones without a message.

What a worker masks is its weighted update: (w_i / Σ_roster w_j) · (x_i − x_global), the weights being its
sample count or DWFed's ISH weight, which the service knows anyway. Each coordinate is clipped to
[−CLIP, CLIP]; an update of a sane learning rate moves no weight by that much in one round, and the worker
logs how many coordinates it clipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from fedbroker.errors import ConfigError
from fedbroker.job.privacy import DistributedDP
from fedbroker.secagg.params import SecAggParams
from fedbroker.secagg.skellam import DDPRound, choose

CLIP = 8.0                 # B: each weighted coordinate of the update delta is clipped to [-B, B]
KEY_FRACTION = 0.25        # the roster is fixed once every participant advertised, or at this share of the round
SHARE_FRACTION = 0.5       # the inboxes are fixed once every roster member shared, or at this share of the round
VERIFY_FRACTION = 0.6      # who is excluded is fixed once every inbox holder checked its inbox, or at this share
UNMASK_WAIT_S = 60.0       # after the survivors are named: how long the close waits for enough unmask shares
LONG_POLL_S = 20.0         # the longest the service holds one waiting call (the worker asks again)
WAITING_CALLS = 16         # waiting calls the service holds at once; beyond, it answers "not yet" at once
REPOLL_S = (0.2, 1.0)      # a worker's pause before asking again after "not yet" (uniform, jittered)
# What a service that took a secure round over (restarted on its spool, or a replica after the owner died) says
# of it; the coordinator re-opens such a round (coordinator/secure_reopen.py) instead of failing the job.
ROUND_LOST = "its keys and masked sum were held only in memory"


def round_params(n: int) -> SecAggParams:
    """The settings of a secure round of `n` participants (at least 2; submission asks for 3)."""
    return SecAggParams.choose(n, CLIP)


def ddp_round_params(*, participants: int, distributed: DistributedDP, dimension: int, records: int) -> DDPRound:
    """A distributed-DP round's settings (`privacy.distributed`), derived alike by the service and each worker.

    Inputs, all known to both ends before any key is drawn: `participants`, the round's n (the task's
    `participants`); `distributed`, the job's installed section (z, C, q, quorum); `dimension`, the trainable
    parameter count (the masked vector's length); `records`, the participants' registered record counts summed,
    which the service sends as `SecParams.ddp_records` (a worker checks its own count is within it). Deterministic:
    the same inputs give the same ring bits, γ and wrap bound on every machine.
    """
    if participants < distributed.quorum:
        raise ConfigError("privacy.distributed.quorum", f"a round of {participants} participants cannot reach a "
                                                        f"quorum of {distributed.quorum} survivors")
    if dimension < 1 or records < 1:
        raise ConfigError("privacy.distributed", f"a round needs parameters and records, got dimension {dimension} "
                                                 f"and {records} records")
    return choose(clip=distributed.clip, noise_multiplier=distributed.noise_multiplier, quorum=distributed.quorum,
                  n_max=participants, dim=dimension, sample_rate=distributed.sample_rate, max_records=records)


def ddp_secagg_params(n: int, ddp: DDPRound) -> SecAggParams:
    """The SecAgg+ settings of a distributed-DP round of n: the masking graph and threshold of `round_params`,
    in the ring the round's signed values live in (the masks cancel mod 2^bits as in any ring)."""
    plain = round_params(n)
    return SecAggParams(n_max=plain.n_max, threshold=plain.threshold, neighbours=plain.neighbours, bits=ddp.bits,
                        clip=plain.clip)


def below_quorum(named: int, participants: int, quorum: int) -> str:
    """Why a site of a distributed-DP round must keep its unmask shares ("" when it may send them): the service
    names fewer survivors than the quorum, so the sum it would unmask carries less noise than the shares were sized
    for. A site sees every survivor only where each site masks with every other (`round_params(n)`'s complete
    graph, n ≤ 20); in a sparse round it sees its neighbourhood, and the check is the service's alone."""
    if quorum and round_params(participants).complete_graph(participants) and named < quorum:
        return (f"the service names {named} survivor(s), below the round's quorum of {quorum}: a sum of so few would "
                f"carry less noise than promised, so this site keeps its unmask shares")
    return ""


def round_seed(job_id: str, round_number: int, version: int) -> bytes:
    """The round's public seed, which both ends derive from what they already share (no message): it binds
    the keys, shares and masks to this job, round and global version."""
    return hashlib.sha256(f"fedbroker secagg\x00{job_id}\x00{round_number}\x00{version}".encode()).digest()


def needed_uploads(n: int) -> int:
    """The fewest masked uploads a round of `n` participants can close with: its threshold t (the survivors
    must hold t shares of every secret to unmask the sum)."""
    return round_params(n).threshold


def describe(n: int, *, distributed: Mapping[str, Any] | None = None) -> str:
    """The settings a round of `n` participants runs with, in words (the job's view); with the job's
    `privacy.distributed` section, what each site masks instead of its weighted update."""
    p = round_params(n)
    graph = "every peer" if p.complete_graph(n) else f"{p.neighbours} neighbours each"
    if distributed:
        return (f"SecAgg+ threshold {p.threshold} of {n} ({graph}); distributed DP: each site masks its clipped "
                f"gradient sum (C {distributed.get('clip')}, q {distributed.get('sample_rate')}) with its Skellam "
                f"share, sized so that a quorum of {distributed.get('quorum')} carries noise z·C "
                f"(z {distributed.get('noise_multiplier')}); each round's ring, γ and noise are in its record below")
    return (f"SecAgg+ ring 2^{p.bits}, clip ±{p.clip:g} per weighted coordinate of the update (quantisation "
            f"step {p.step:.3g}), threshold {p.threshold} of {n} ({graph})")


def phase_deadlines(opened: float, deadline: float) -> tuple[float, float, float]:
    """(roster fixed by, inboxes fixed by, exclusions fixed by): shares of the round's time, so training keeps
    the rest."""
    span = max(deadline - opened, 0.0)
    return opened + KEY_FRACTION * span, opened + SHARE_FRACTION * span, opened + VERIFY_FRACTION * span


def threshold_note(n: int) -> str:
    """Why a round of `n` cannot close with fewer uploads, for a refusal's message."""
    return f"a secure round of {n} needs {needed_uploads(n)} masked uploads (its threshold) to be unmasked"

