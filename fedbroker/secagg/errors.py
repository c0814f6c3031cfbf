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
