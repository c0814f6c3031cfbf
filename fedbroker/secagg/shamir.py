"""Shamir t-out-of-n secret sharing of 32-byte secrets over the prime field GF(2^521 − 1).

The field is the Mersenne prime 2^521 − 1, so any 32-byte secret (a mask seed, an X25519 private key)
is one field element and needs no splitting; a share is one element, 66 bytes. A share's x-coordinate
is derived from its holder's id (`share_point`), so sender and service agree on it without an index
table; ids whose points collide (probability about n²/2^521) are refused.

Security: the secret is f(0) for f of degree t − 1 with uniform coefficients a_1..a_{t−1}. For any t − 1
distinct non-zero points the map (a_1..a_{t−1}) → (f(x_1)..f(x_{t−1})) is a bijection (a Vandermonde
system), so those shares are uniform and independent of the secret: every secret is equally consistent
with them. Any t shares determine f, and `reconstruct` checks that any further shares lie on it.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Mapping, Sequence

from fedbroker.secagg.errors import ShareMismatch, TooFewSurvivors

PRIME = 2**521 - 1
SECRET_BYTES = 32
SHARE_BYTES = 66  # ceil(521 / 8)


def share_point(holder_id: str) -> int:
    """The non-zero x-coordinate at which `holder_id`'s share of any secret is evaluated."""
    digest = hashlib.sha512(b"fedbroker secagg share point\0" + holder_id.encode()).digest()
    return int.from_bytes(digest, "big") % (PRIME - 1) + 1


def _poly_eval(coefficients: Sequence[int], x: int) -> int:
    value = 0
    for c in reversed(coefficients):
        value = (value * x + c) % PRIME
    return value


def split(secret: bytes, holders: Sequence[str], threshold: int, *,
          randbelow: Callable[[int], int] = secrets.randbelow) -> dict[str, int]:
    """Shares of a 32-byte secret for each holder, any `threshold` of which rebuild it.

    `randbelow` draws the polynomial's coefficients; the default is the OS CSPRNG (tests pass a seeded
    one to pin the security argument).
    """
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold must be in 1..{len(holders)} holders, got {threshold}")
    points = {h: share_point(h) for h in holders}
    if len(set(points.values())) != len(holders):
        raise ValueError("two holders' ids map to one share point (or a holder is listed twice)")
    coefficients = [int.from_bytes(secret, "big")] + [randbelow(PRIME) for _ in range(threshold - 1)]
    return {h: _poly_eval(coefficients, x) for h, x in points.items()}


class _Lagrange:
    """The polynomial of degree < len(points) through `points`, evaluated anywhere; its Lagrange
    denominators are inverted once, so checking many further shares costs no more inversions."""

    def __init__(self, points: Sequence[tuple[int, int]]) -> None:
        self.xs = [x for x, _ in points]
        self.weights = []
        for j, (xj, yj) in enumerate(points):
            den = 1
            for m, xm in enumerate(self.xs):
                if m != j:
                    den = den * (xj - xm) % PRIME
            self.weights.append(yj * pow(den, -1, PRIME) % PRIME)

    def at(self, x: int) -> int:
        total = 0
        for j, w in enumerate(self.weights):
            num = w
            for m, xm in enumerate(self.xs):
                if m != j:
                    num = num * (x - xm) % PRIME
            total += num
        return total % PRIME


def reconstruct(shares: Mapping[str, int], threshold: int) -> bytes:
    """The 32-byte secret from at least `threshold` shares keyed by holder id.

    Raises TooFewSurvivors below the threshold, and ShareMismatch when the shares beyond the first t do
    not lie on the polynomial the first t define, or the secret does not fit 32 bytes (a corrupt share).
    """
    if len(shares) < threshold:
        raise TooFewSurvivors(f"{len(shares)} shares, the threshold is {threshold}")
    for holder, y in shares.items():
        if not 0 <= y < PRIME:
            raise ShareMismatch(f"the share held by {holder!r} is not a field element")
    ordered = sorted((share_point(h), y) for h, y in shares.items())
    if len({x for x, _ in ordered}) != len(ordered):
        raise ShareMismatch("two shares sit at one point")
    polynomial = _Lagrange(ordered[:threshold])
    for x, y in ordered[threshold:]:
        if polynomial.at(x) != y:
            raise ShareMismatch(f"{len(shares)} shares do not lie on one polynomial of degree {threshold - 1}")
    secret = polynomial.at(0)
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ShareMismatch("the rebuilt secret is longer than 32 bytes: a share is corrupt")
    return secret.to_bytes(SECRET_BYTES, "big")


def encode_share(y: int) -> bytes:
    """A share as 66 big-endian bytes (the form it travels in)."""
    return y.to_bytes(SHARE_BYTES, "big")


def decode_share(data: bytes) -> int:
    """A share from its 66 bytes; raises ShareMismatch on a wrong length or a value outside the field."""
    if len(data) != SHARE_BYTES:
        raise ShareMismatch(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise ShareMismatch("a share is not a field element")
    return y
