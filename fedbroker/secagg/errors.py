"""Errors of the secure-aggregation protocol: one base, two kinds a service may want to tell apart."""

from __future__ import annotations

from fedbroker.errors import FedbrokerError


class SecAggError(FedbrokerError, ValueError):
    """A step of SecAgg+ was refused: out of order, from an unknown or duplicate party, or malformed."""

    reason = "secagg"


class TooFewSurvivors(SecAggError):
    """Fewer than the threshold t survived (or answered): the round's sum cannot be unmasked."""

    reason = "secagg_too_few_survivors"


class ShareMismatch(SecAggError):
    """Shares of one secret do not lie on one polynomial, or a rebuilt key does not match its public half."""

    reason = "secagg_share_mismatch"


class Dishonest(ShareMismatch):
    """One named worker sent what the protocol proves wrong (a malformed share message, or an unmask share
    that does not match its dealer's commitment): a service excludes that worker and goes on if it can."""

    reason = "secagg_dishonest"

    def __init__(self, worker_id: str, why: str) -> None:
        super().__init__(why)
        self.worker_id = worker_id
