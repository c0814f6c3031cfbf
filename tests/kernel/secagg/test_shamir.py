"""Shamir sharing over GF(2^521 − 1): any t shares rebuild the secret, t − 1 shares say nothing about it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.secagg import shamir
from fedbroker.secagg.errors import ShareMismatch, TooFewSurvivors

P = shamir.PRIME
secrets_32 = st.binary(min_size=32, max_size=32)


def _holders(n: int) -> list[str]:
    return [f"worker-{i}" for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(secret=secrets_32, n=st.integers(2, 12), data=st.data())
def test_any_t_shares_rebuild_the_secret(secret: bytes, n: int, data: st.DataObject) -> None:
    t = data.draw(st.integers(1, n), label="t")
    shares = shamir.split(secret, _holders(n), t)
    subset = data.draw(st.lists(st.sampled_from(sorted(shares)), min_size=t, max_size=n, unique=True), label="subset")
    assert shamir.reconstruct({h: shares[h] for h in subset}, t) == secret


def _solve_mod_p(matrix: list[list[int]], rhs: list[int]) -> list[int]:
    """Gaussian elimination mod P (the test's own, independent of the module's Lagrange code)."""
    m = [row[:] + [b] for row, b in zip(matrix, rhs)]
    size = len(m)
    for col in range(size):
        pivot = next(r for r in range(col, size) if m[r][col] % P)
        m[col], m[pivot] = m[pivot], m[col]
        inv = pow(m[col][col], -1, P)
        m[col] = [v * inv % P for v in m[col]]
        for r in range(size):
            if r != col and m[r][col]:
                f = m[r][col]
                m[r] = [(a - f * b) % P for a, b in zip(m[r], m[col])]
    return [row[-1] for row in m]


@settings(max_examples=40, deadline=None)
@given(secret_a=secrets_32, secret_b=secrets_32, n=st.integers(3, 10), data=st.data())
def test_t_minus_one_shares_are_consistent_with_any_other_secret(secret_a: bytes, secret_b: bytes, n: int,
                                                                 data: st.DataObject) -> None:
    """For the t − 1 shares an adversary holds there is exactly one set of coefficients producing them for
    secret B as well: split(B) with those coefficients gives the very same shares, so they cannot tell A
    from B (and the full sharings differ, so this is not a degenerate case)."""
    t = data.draw(st.integers(2, n), label="t")
    seeded = random.Random(data.draw(st.integers(0, 2**32), label="seed"))
    holders = _holders(n)
    shares_a = shamir.split(secret_a, holders, t, randbelow=seeded.randrange)
    seen = data.draw(st.lists(st.sampled_from(holders), min_size=t - 1, max_size=t - 1, unique=True), label="seen")
    b = int.from_bytes(secret_b, "big")
    xs = [shamir.share_point(h) for h in seen]
    # coefficients c_1..c_{t-1} with B + Σ c_k x^k = share_A(x) at every seen point
    coefficients = _solve_mod_p([[pow(x, k, P) for k in range(1, t)] for x in xs],
                                [(shares_a[h] - b) % P for h in seen])
    feed = iter(coefficients)
    shares_b = shamir.split(secret_b, holders, t, randbelow=lambda _bound: next(feed))
    assert {h: shares_b[h] for h in seen} == {h: shares_a[h] for h in seen}
    assert shamir.reconstruct(shares_b, t) == secret_b
    assert shamir.reconstruct(shares_a, t) == secret_a


def test_fixed_seed_two_secrets_share_the_same_t_minus_one_shares() -> None:
    """The same argument at one fixed seed, spelled out: 3-of-5, two holders' shares fit both secrets."""
    seeded = random.Random(20261126)
    holders = _holders(5)
    a, b = bytes(range(32)), bytes(range(100, 132))
    shares_a = shamir.split(a, holders, 3, randbelow=seeded.randrange)
    seen = holders[1:3]
    xs = [shamir.share_point(h) for h in seen]
    coeffs = _solve_mod_p([[x % P, x * x % P] for x in xs],
                          [(shares_a[h] - int.from_bytes(b, "big")) % P for h in seen])
    feed = iter(coeffs)
    shares_b = shamir.split(b, holders, 3, randbelow=lambda _bound: next(feed))
    assert [shares_b[h] for h in seen] == [shares_a[h] for h in seen]
    assert shamir.reconstruct({h: shares_b[h] for h in holders[:3]}, 3) == b
    with pytest.raises(TooFewSurvivors):
        shamir.reconstruct({h: shares_a[h] for h in seen}, 3)


def test_a_corrupt_share_among_more_than_t_is_detected() -> None:
    shares = shamir.split(b"\x07" * 32, _holders(6), 3)
    shares["worker-4"] = (shares["worker-4"] + 1) % P
    with pytest.raises(ShareMismatch, match="one polynomial"):
        shamir.reconstruct(shares, 3)


def test_a_share_outside_the_field_or_of_a_wrong_length_is_refused() -> None:
    with pytest.raises(ShareMismatch, match="66 bytes"):
        shamir.decode_share(b"\x01" * 65)
    with pytest.raises(ShareMismatch, match="field element"):
        shamir.decode_share(b"\xff" * 66)
    assert shamir.decode_share(shamir.encode_share(P - 1)) == P - 1


def test_share_points_are_distinct_and_never_zero() -> None:
    points = [shamir.share_point(h) for h in _holders(2000)]
    assert len(set(points)) == len(points)
    assert all(0 < x < P for x in points)


def test_split_refuses_a_repeated_holder_or_a_wrong_secret_size() -> None:
    with pytest.raises(ValueError, match="twice"):
        shamir.split(b"\0" * 32, ["a", "a", "b"], 2)
    with pytest.raises(ValueError, match="32 bytes"):
        shamir.split(b"\0" * 31, ["a", "b"], 2)
