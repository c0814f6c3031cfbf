"""A secure round the aggregation service lost, given up and opened again (deploy/OPERATING.md "Aggregation
replicas").

A secure round's keys, routed shares and masked sum live only in the memory of the replica that owns the job.
When that replica dies (or the service restarts on its spool), the one that takes the job over refuses the
round's every step with `ROUND_LOST` in its reason (`SecureSession.lost`): nothing can unmask that sum. The
coordinator then abandons the round (recorded `abandoned` with the reason; the ε its participants report for
training they did stays on their rows) and opens a fresh round under the next number from the same global
version, at most `MAX_SECURE_REOPENS` times per job; past that the job fails naming the cause. A round number
is never reused: the abandoned round keeps its row and its participants' history.

How the loss is seen: the service's own answer to the close (a `secure_protocol` refusal carrying
`ROUND_LOST`). Two hints make the coordinator ask for that answer: uploads it counted that the service no
longer lists (ends the round's wait at once), or, once every participant answered or the deadline passed, a
participant reporting the lost round's reason. A hint alone re-opens nothing (a site may write anything in its
report): only the service's refusal does, and a secure round that failed otherwise (too few unmask shares, a
cheat proven) still fails the job as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedbroker.coordinator.job_run import OpenRound
from fedbroker.coordinator.store import StateStore
from fedbroker.job.status import ParticipantStatus, RoundStatus
from fedbroker.secagg.secure_round import ROUND_LOST

MAX_SECURE_REOPENS = 3   # lost secure rounds a job re-opens; one more fails it


class RoundLost(Exception):
    """The aggregation service lost the secure round `round` (its refusal's text is `why`)."""

    def __init__(self, rnd: OpenRound, why: str) -> None:
        super().__init__(why)
        self.round = rnd
        self.why = why


def is_lost(why: str) -> bool:
    """Whether a `secure_protocol` refusal of the close says the service lost the round (not: the round failed)."""
    return ROUND_LOST in why


def lost_hint(store: StateStore, job_id: str, round_number: int, accepted: Sequence[str], *,
              reports: bool = True) -> bool:
    """Whether the round may have been lost at the service: an upload it had counted is no longer listed
    (the service's own word), or (`reports`) a participant's report carries the lost round's reason (a site's
    word: heeded only once the round's wait is over, so no site can cut a round short). Only a hint: the
    close's answer decides."""
    rows = store.participants(job_id, round_number)
    counted = {p.worker_id for p in rows if p.status == ParticipantStatus.UPLOADED}
    return bool(counted - set(accepted)) or (reports and any(is_lost(p.reason or "") for p in rows))


def reopened(store: StateStore, job_id: str) -> int:
    """How many of the job's rounds were abandoned and opened again (a running job abandons no other)."""
    return sum(r.status == RoundStatus.ABANDONED for r in store.rounds(job_id))


def exhausted(rnd: OpenRound, why: str, times: int) -> str:
    """The job's error once the bound is reached."""
    return (f"round {rnd.number}: {why}; this job already re-opened {times} lost secure round(s), the most it may "
            f"(MAX_SECURE_REOPENS {MAX_SECURE_REOPENS}), so it fails here")
