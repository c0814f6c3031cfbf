"""A whole SecAgg+ round: the service recovers exactly the survivors' weighted sum, and nothing finer."""

from __future__ import annotations

import ast
import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.secagg import (
    Dishonest,
    PublicKeys,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    ShareMismatch,
    TooFewSurvivors,
    neighbour_graph,
    shamir,
)
from fedbroker.secagg.local import run_round
from tests.source_roots import ROOT

SEED = b"job-7/round-3/seed"


def _inputs(n: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 2.0, n)
    weights /= weights.sum()
    return {f"w{i:03d}": weights[i] * rng.normal(0, 0.3, length) for i in range(n)}


def _plain(inputs: dict[str, np.ndarray], who: list[str] | tuple[str, ...]) -> np.ndarray:
    return np.sum([inputs[w] for w in who], axis=0)


def test_unmasked_sum_equals_the_plain_weighted_sum_within_the_quantisation_bound() -> None:
    inputs = _inputs(8, 1000)
    params = SecAggParams.choose(8, 1.0)
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(0))
    assert result.survivors == tuple(sorted(inputs)) and result.dropped == ()
    assert np.abs(result.total - _plain(inputs, sorted(inputs))).max() <= result.error_max


def test_n_minus_t_dropouts_after_masking_are_recovered() -> None:
    n = 10
    params = SecAggParams.choose(n, 1.0)
    inputs = _inputs(n, 500, seed=1)
    gone = sorted(inputs)[: n - params.threshold]
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(1), drop_before_masking=gone)
    assert len(result.survivors) == params.threshold and result.dropped == tuple(gone)
    assert np.abs(result.total - _plain(inputs, result.survivors)).max() <= result.error_max


def test_dropouts_at_every_stage_still_give_the_survivors_sum() -> None:
    n = 12
    params = SecAggParams.choose(n, 1.0)
    inputs = _inputs(n, 300, seed=2)
    ids = sorted(inputs)
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(2), drop_before_sharing=ids[:1],
                       drop_before_masking=ids[1:3], drop_before_unmask=ids[3:4])
    assert result.survivors == tuple(ids[3:])  # a worker silent at unmask still masked its input: it counts
    assert result.dropped == tuple(ids[1:3])
    assert np.abs(result.total - _plain(inputs, ids[3:])).max() <= result.error_max


def test_a_sparse_graph_of_100_recovers_with_ten_percent_dropout() -> None:
    n = 100
    params = SecAggParams.choose(n, 1.0)
    assert not params.complete_graph(n)
    inputs = _inputs(n, 200, seed=3)
    gone = list(np.random.default_rng(3).choice(sorted(inputs), 10, replace=False))
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(3), drop_before_masking=gone)
    assert len(result.survivors) == 90
    assert np.abs(result.total - _plain(inputs, result.survivors)).max() <= result.error_max


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 14), data=st.data())
def test_any_dropout_set_leaving_t_survivors_recovers_their_sum(n: int, data: st.DataObject) -> None:
    params = SecAggParams.choose(n, 0.5)
    inputs = {w: np.clip(x, -0.5, 0.5) for w, x in _inputs(n, 40, seed=n).items()}
    ids = sorted(inputs)
    gone = data.draw(st.lists(st.sampled_from(ids), max_size=n - params.threshold, unique=True), label="gone")
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(n), drop_before_masking=gone)
    assert result.survivors == tuple(w for w in ids if w not in gone)
    assert np.abs(result.total - _plain(inputs, result.survivors)).max() <= result.error_max


def _through_inboxes(n: int, params: SecAggParams, length: int = 64, *, verify: bool = True
                     ) -> tuple[SecAggServer, dict[str, SecAggClient], dict[str, dict[str, bytes]]]:
    """A round of n honest clients through sharing; with `verify`, through verification too (ready to mask)."""
    server = SecAggServer(params, SEED, length=length)
    clients = {f"w{i}": SecAggClient(f"w{i}", params, SEED, np.random.default_rng(i)) for i in range(n)}
    for w, c in clients.items():
        server.add_keys(w, c.advertise())
    rosters = server.rosters()
    for w, c in clients.items():
        server.add_shares(w, c.share_keys(rosters[w]))
    inboxes = server.inboxes()
    if verify:
        _verified(server, clients, inboxes)
    return server, clients, inboxes


def _verified(server: SecAggServer, clients: dict[str, SecAggClient],
              inboxes: dict[str, dict[str, bytes]]) -> None:
    """Every recipient opens its inbox (all honest: nothing fails) and the server closes verification."""
    assert all(clients[w].open_inbox(box) == {} for w, box in inboxes.items())
    server.exclude(())


def _arrays(value: Any, seen: set[int]) -> list[np.ndarray]:
    """Every numpy array reachable from an object's attributes (dicts, lists, tuples, sets followed)."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, dict):
        return [a for k, v in value.items() for a in _arrays(k, seen) + _arrays(v, seen)]
    if isinstance(value, list | tuple | set | frozenset):
        return [a for v in value for a in _arrays(v, seen)]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return _arrays(vars(value), seen)
    return []


def test_the_server_never_holds_an_individual_input() -> None:
    params = SecAggParams.choose(5, 1.0)
    server, clients, _ = _through_inboxes(5, params)
    inputs = {w: x for w, x in zip(sorted(clients), _inputs(5, 64, seed=4).values())}
    masked = {}
    for w, c in clients.items():
        masked[w] = c.masked_input(inputs[w])
        server.add_masked(w, masked[w])
        arrays = _arrays(server, set())
        assert len(arrays) == 1 and arrays[0] is server._sum  # the running sum and nothing else
        assert all(arrays[0] is not y and not np.shares_memory(arrays[0], y) for y in masked.values())
    for a in _arrays(server, set()):
        for w in inputs:
            assert not np.allclose(a.astype(np.float64), inputs[w])
    kept = {k: type(v).__name__ for k, v in vars(server).items()}
    assert set(kept) == {"params", "ddp", "round_seed", "length", "_stage", "_keys", "_graph", "_inboxes", "_sent",
                         "_masked", "_sum", "_requests", "_replies", "_lock", "_commitments"}, "a new attribute: check it holds no input"
    requests = server.unmask_requests()
    for w, r in requests.items():
        server.add_unmask(w, clients[w].unmask(r.survivors, r.dropped))
    result = server.finish()
    assert _arrays(server, set()) == []  # the running sum is released with the result
    assert np.abs(result.total - _plain(inputs, sorted(inputs))).max() <= result.error_max


def test_the_service_sees_only_sealed_shares_bound_to_sender_receiver_and_round() -> None:
    params = SecAggParams.choose(4, 1.0)
    _, clients, inboxes = _through_inboxes(4, params, verify=False)
    sealed = inboxes["w0"]["w1"]
    misrouted = {**inboxes["w2"], "w1": sealed}  # w1's message to w0, handed to w2
    assert "fails authentication" in clients["w2"].open_inbox(misrouted)["w1"]
    tampered = {**inboxes["w0"], "w1": sealed[:-1] + bytes([sealed[-1] ^ 1])}
    assert "fails authentication" in clients["w0"].open_inbox(tampered)["w1"]
    with pytest.raises(SecAggError, match="did not exclude"):  # it never masks with a sender that failed
        clients["w0"].masked_input(np.zeros(64))
    _, clients, _ = _through_inboxes(4, params)
    b_share, s_share = clients["w0"]._held["w1"]
    routed = b"".join(ct for box in inboxes.values() for ct in box.values())
    assert shamir.encode_share(b_share) not in routed and shamir.encode_share(s_share) not in routed


def test_a_client_refuses_to_reveal_both_shares_for_one_peer() -> None:
    params = SecAggParams.choose(5, 1.0)
    _, clients, _ = _through_inboxes(5, params)
    for c in clients.values():
        c.masked_input(np.zeros(64))
    everyone = set(clients)
    with pytest.raises(SecAggError, match="both survivor and dropped"):
        clients["w0"].unmask(everyone, {"w3"})
    with pytest.raises(SecAggError, match="next step is done"):  # and it never answers again
        clients["w0"].unmask(everyone - {"w3"}, {"w3"})
    shares = clients["w1"].unmask(everyone - {"w3"}, {"w3"})
    assert set(shares) == everyone  # b-shares of 4 survivors (itself included), the s-share of w3, once each
    with pytest.raises(SecAggError, match="next step is done"):
        clients["w1"].unmask(everyone, set())


def test_a_client_refuses_to_unmask_when_fewer_than_t_survived_or_it_is_not_a_survivor() -> None:
    params = SecAggParams.choose(5, 1.0)  # t = 3
    _, clients, _ = _through_inboxes(5, params)
    for c in clients.values():
        c.masked_input(np.zeros(64))
    with pytest.raises(TooFewSurvivors):
        clients["w0"].unmask({"w0", "w1"}, {"w2", "w3", "w4"})
    with pytest.raises(SecAggError, match="not listed as a survivor"):
        clients["w1"].unmask({"w2", "w3", "w4"}, {"w1"})


def test_a_client_refuses_steps_out_of_order() -> None:
    client = SecAggClient("a", SecAggParams.choose(3, 1.0), SEED, np.random.default_rng(0))
    with pytest.raises(SecAggError, match="next step is advertise"):
        client.masked_input(np.zeros(3))
    with pytest.raises(SecAggError, match="round seed"):
        SecAggClient("a", SecAggParams.choose(3, 1.0), b"short", np.random.default_rng(0))


def test_the_server_refuses_duplicate_unknown_and_malformed_messages() -> None:
    params = SecAggParams.choose(4, 1.0)
    server = SecAggServer(params, SEED, length=8)
    clients = {w: SecAggClient(w, params, SEED, np.random.default_rng(0)) for w in "abcd"}
    for w, c in clients.items():
        server.add_keys(w, c.advertise())
    with pytest.raises(SecAggError, match="twice"):
        server.add_keys("a", PublicKeys(b"1" * 32, b"2" * 32))
    rosters = server.rosters()
    with pytest.raises(SecAggError, match="stage"):
        server.add_keys("e", PublicKeys(b"1" * 32, b"2" * 32))
    shares = {w: c.share_keys(rosters[w]) for w, c in clients.items()}
    with pytest.raises(SecAggError, match="unknown worker"):
        server.add_shares("z", shares["a"])
    with pytest.raises(SecAggError, match="exactly its neighbours"):
        server.add_shares("a", {k: v for k, v in shares["a"].items() if k != "b"})
    for w in "abcd":
        server.add_shares(w, shares[w])
    with pytest.raises(SecAggError, match="twice"):
        server.add_shares("a", shares["a"])
    _verified(server, clients, server.inboxes())
    masked = {w: c.masked_input(np.zeros(8)) for w, c in clients.items()}
    with pytest.raises(SecAggError, match="8"):
        server.add_masked("a", masked["a"][:7])
    with pytest.raises(SecAggError, match="uint32"):
        server.add_masked("a", masked["a"].astype(np.int64))
    with pytest.raises(SecAggError, match="did not share"):
        server.add_masked("z", masked["a"])
    for w in "abc":
        server.add_masked(w, masked[w])
    with pytest.raises(SecAggError, match="twice"):
        server.add_masked("a", masked["a"])
    requests = server.unmask_requests()
    assert requests["a"].dropped == {"d"}
    with pytest.raises(SecAggError, match="not a survivor"):
        server.add_unmask("d", {})
    reply = clients["a"].unmask(requests["a"].survivors, requests["a"].dropped)
    with pytest.raises(SecAggError, match="nobody asked"):
        server.add_unmask("a", {**reply, "zz": reply["a"]})
    with pytest.raises(ShareMismatch, match="66 bytes"):
        server.add_unmask("a", {**reply, "b": reply["b"][:10]})


def test_too_few_survivors_is_a_clear_error() -> None:
    params = SecAggParams.choose(5, 1.0)  # t = 3
    server, clients, _ = _through_inboxes(5, params, length=4)
    for w in ("w0", "w1"):
        server.add_masked(w, clients[w].masked_input(np.zeros(4)))
    with pytest.raises(TooFewSurvivors, match="2 masked inputs arrived, the threshold is 3"):
        server.unmask_requests()


def test_too_few_unmask_replies_or_a_corrupt_share_fail_reconstruction_loudly() -> None:
    params = SecAggParams.choose(5, 1.0)  # t = 3
    server, clients, _ = _through_inboxes(5, params, length=4)
    for w in ("w0", "w1", "w2", "w3"):
        server.add_masked(w, clients[w].masked_input(np.ones(4)))
    requests = server.unmask_requests()
    for w in ("w0", "w1"):
        server.add_unmask(w, clients[w].unmask(requests[w].survivors, requests[w].dropped))
    with pytest.raises(TooFewSurvivors, match="2 shares, the threshold is 3"):
        server.finish()


def test_a_survivor_that_shifts_a_share_it_reveals_is_named_and_the_sum_comes_from_the_honest_shares() -> None:
    """The attack: with exactly t replies a shifted share rebuilt a wrong b and moved the sum undetected; now
    each revealed share is checked against its dealer's commitment, whichever t arrive."""
    params = SecAggParams.choose(5, 1.0)  # t = 3
    inputs = {f"w{int(w[1:])}": x for w, x in _inputs(5, 4).items()}
    server, clients, _ = _through_inboxes(5, params, length=4)
    for w, c in clients.items():
        server.add_masked(w, c.masked_input(inputs[w]))
    requests = server.unmask_requests()
    replies = {w: c.unmask(requests[w].survivors, requests[w].dropped) for w, c in clients.items()}
    shifted, victim = dict(replies["w4"]), min(set(replies["w4"]) - {"w4"})
    shifted[victim] = shamir.encode_share((shamir.decode_share(shifted[victim]) + 24) % shamir.PRIME)
    with pytest.raises(Dishonest, match=f"'w4'.*not the one '{victim}' dealt it") as caught:
        server.add_unmask("w4", shifted)
    assert caught.value.worker_id == "w4"
    for w in ("w0", "w1", "w2"):  # exactly t honest replies
        server.add_unmask(w, replies[w])
    result = server.finish()
    assert np.abs(result.total - _plain(inputs, sorted(inputs))).max() <= result.error_max


def test_a_garbled_or_oversized_share_message_is_caught_before_anyone_masks_and_its_dealer_excluded() -> None:
    params = SecAggParams.choose(5, 1.0)  # t = 3
    inputs = {f"w{int(w[1:])}": x for w, x in _inputs(5, 4).items()}
    server = SecAggServer(params, SEED, length=4)
    clients = {f"w{i}": SecAggClient(f"w{i}", params, SEED, np.random.default_rng(i)) for i in range(5)}
    for w, c in clients.items():
        server.add_keys(w, c.advertise())
    rosters = server.rosters()
    shares = {w: c.share_keys(rosters[w]) for w, c in clients.items()}
    with pytest.raises(SecAggError, match="'w4' is 3000000 bytes"):  # bounded at the door
        server.add_shares("w4", {**shares["w4"], "w0": bytes(3_000_000)})
    garbled = {p: m[:64] + bytes(len(m) - 64) for p, m in shares["w3"].items()}  # the right size, not sealed
    for w in ("w0", "w1", "w2"):
        server.add_shares(w, shares[w])
    server.add_shares("w3", garbled)
    inboxes = server.inboxes()
    failed = {w: clients[w].open_inbox(box) for w, box in inboxes.items()}
    assert {w: sorted(f) for w, f in failed.items()} == {"w0": ["w3"], "w1": ["w3"], "w2": ["w3"], "w3": []}
    assert "fails authentication" in failed["w0"]["w3"]
    server.exclude({"w3"})
    for w in ("w0", "w1", "w2"):
        server.add_masked(w, clients[w].masked_input(inputs[w], {"w3"}))
    with pytest.raises(SecAggError, match="did not share"):
        server.add_masked("w3", clients["w3"].masked_input(inputs["w3"], {"w3"}))
    requests = server.unmask_requests()
    for w, r in requests.items():
        server.add_unmask(w, clients[w].unmask(r.survivors, r.dropped))
    result = server.finish()
    assert result.survivors == ("w0", "w1", "w2")
    assert np.abs(result.total - _plain(inputs, ["w0", "w1", "w2"])).max() <= result.error_max


def test_verification_that_leaves_fewer_than_t_fails_the_round_before_anyone_masks() -> None:
    params = SecAggParams.choose(5, 1.0)  # t = 3
    server, _, _ = _through_inboxes(5, params, verify=False)
    with pytest.raises(TooFewSurvivors, match="2 workers remain"):
        server.exclude({"w0", "w1", "w2"})


def test_the_neighbour_graph_is_k_regular_symmetric_and_drawn_from_the_round_seed() -> None:
    ids = [f"w{i:03d}" for i in range(100)]
    graph = neighbour_graph(ids, 20, SEED)
    assert all(len(nbrs) == 20 and w not in nbrs for w, nbrs in graph.items())
    assert all(w in graph[v] for w, nbrs in graph.items() for v in nbrs)
    assert graph == neighbour_graph(list(reversed(ids)), 20, SEED)
    assert graph != neighbour_graph(ids, 20, b"another round seed")
    assert neighbour_graph(ids[:5], 20, SEED)["w000"] == frozenset(ids[1:5])


def test_the_package_imports_no_transport() -> None:
    package = ROOT / "fedbroker" / "secagg"
    banned = ("grpc", "pika", "prometheus_client", "torch")
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in banned for n in names), f"{path.name} imports {names}"


def test_masked_inputs_added_from_many_threads_give_the_same_sum() -> None:
    n, length = 8, 200_000
    params = SecAggParams.choose(n, 1.0)
    server, clients, _ = _through_inboxes(n, params, length=length)
    inputs = {w: x[:length] for w, x in zip(sorted(clients), _inputs(n, length, seed=6).values())}
    masked = {w: c.masked_input(inputs[w]) for w, c in clients.items()}
    threads = [threading.Thread(target=server.add_masked, args=(w, y)) for w, y in masked.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    requests = server.unmask_requests()
    assert set(requests) == set(clients)
    for w, r in requests.items():
        server.add_unmask(w, clients[w].unmask(r.survivors, r.dropped))
    result = server.finish()
    assert np.abs(result.total - _plain(inputs, sorted(inputs))).max() <= result.error_max


def test_a_dropped_worker_whose_neighbours_all_dropped_fails_the_round_before_unmasking() -> None:
    n = 30
    params = SecAggParams.choose(n, 1.0, neighbours=4)  # t = 3 of 5 holders
    ids = [f"w{i:02d}" for i in range(n)]
    graph = neighbour_graph(ids, 4, SEED)
    gone = {"w00", *graph["w00"]}
    with pytest.raises(TooFewSurvivors, match="'w00' has 0 survivors among the holders of its shares"):
        run_round({w: np.zeros(8) for w in ids}, params, SEED, rng=np.random.default_rng(0), drop_before_masking=gone)
