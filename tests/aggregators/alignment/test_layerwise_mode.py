"""The layer-wise mode (`alignment: {name: nafi, mode: layerwise}`): round ℓ matches layer ℓ − 1 of the chain,
and every layer matched before stays exactly as it was matched, whatever the sites upload.

The defining property, run over all three rounds of a 3-layer chain: after round ℓ, layer ℓ − 1 of the global
model is the engine's matched average of the sites' layers (what `match_layer` gives on its own), the layers
before it are unchanged from the rounds that matched them, and the output layer of the last round is the
per-class average by the sites' class shares.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedbroker.aggregators.alignment import ALIGNMENT, AlignInput, Layer, match_layer, scatter_inputs
from fedbroker.aggregators.layer_conversion import to_layers
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.job.alignment_plan import alignment_plan
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

SPEC = parse_model({"input_shape": [6], "layers": [
    {"type": "Linear", "in_features": 6, "out_features": 5}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 5, "out_features": 4}, {"type": "Tanh"},
    {"type": "Linear", "in_features": 4, "out_features": 3}]})
WORKERS = ["a", "b", "c"]
SHARES = np.array([[8.0, 1.0, 1.0], [1.0, 8.0, 1.0], [1.0, 1.0, 8.0]])
LAYERWISE = {"alignment": "nafi", "alignment_params": {"mode": "layerwise", "lam": 0.1}}


def network(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in parameter_shapes(SPEC).items()}


def trained(start: dict[str, np.ndarray], round_index: int, seed: int) -> dict[str, np.ndarray]:
    """A site's upload: the round's start with every layer that is not frozen moved (as training would), and the
    units of the layer this round matches shuffled (a site's units come back in its own order)."""
    frozen = alignment_plan(SPEC).frozen_in_round(round_index)
    rng = np.random.default_rng(seed)
    out = {name: (value if name in frozen else value + rng.normal(scale=0.3, size=value.shape)).astype(np.float32)
           for name, value in start.items()}
    node = alignment_plan(SPEC).layers[round_index - 1].node
    nxt = {"0": "2", "2": "4"}.get(node)
    if nxt is not None:
        p = rng.permutation(out[f"{node}.weight"].shape[0])
        out[f"{node}.weight"], out[f"{node}.bias"] = out[f"{node}.weight"][p], out[f"{node}.bias"][p]
        out[f"{nxt}.weight"] = out[f"{nxt}.weight"][:, p]
    return out


def upload(book: RoundBook, state: dict[str, np.ndarray], worker: str, rnd: int) -> None:
    header = pb.UpdateHeader(job_id="j", round=rnd, worker_id=worker, num_samples=10, tensors=codec.tensor_specs(state))
    book.receive_update(codec.stream_messages(pb.UpdateChunk, header, state))


def run_round(book: RoundBook, rnd: int, uploads: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    book.open_round("j", rnd, WORKERS, deadline=1e12, aggregation=LAYERWISE, seed=0,
                    histograms={w: [int(v) for v in SHARES[k]] for k, w in enumerate(WORKERS)})
    for w, state in uploads.items():
        upload(book, state, w, rnd)
    book.close("j", rnd)
    _, spec_json, state = book.global_model("j")
    assert parse_model(json.loads(spec_json)).input_shape == SPEC.input_shape
    return state


def test_each_round_matches_its_layer_and_the_matched_layers_stay_fixed_after() -> None:
    book = RoundBook()
    start = network(99)
    book.put_global("j", 1, SPEC.to_json(), start)
    params = ALIGNMENT.create("nafi", LAYERWISE["alignment_params"]).matching_params()
    history = []
    for rnd in (1, 2, 3):
        uploads = {w: trained(start, rnd, seed=10 * rnd + k) for k, w in enumerate(WORKERS)}
        after = run_round(book, rnd, uploads)
        sites = [to_layers(SPEC, uploads[w]) for w in WORKERS]
        ell = rnd - 1
        for earlier, state in history:  # every layer matched before is exactly as the round that matched it left it
            for name in alignment_plan(SPEC).layers[earlier].tensors():
                np.testing.assert_array_equal(after[name], state[name])
        assert set(alignment_plan(SPEC).frozen_in_round(rnd)) == {
            name for earlier, _ in history for name in alignment_plan(SPEC).layers[earlier].tensors()}
        node = alignment_plan(SPEC).layers[ell].node
        if rnd < 3:  # the engine's matched average of the sites' layer ℓ, as match_layer gives it alone
            expected, _ = match_layer([net[ell] for net in sites], params=params, rng=np.random.default_rng([0, rnd]))
            np.testing.assert_allclose(after[f"{node}.weight"], expected.weight, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(after[f"{node}.bias"], expected.bias, rtol=1e-5, atol=1e-6)
        else:  # the output layer: each class's row averaged by the sites' shares of that class
            shares = SHARES / SHARES.sum(axis=0)
            rows = sum(shares[k][:, None] * net[-1].weight for k, net in enumerate(sites))
            np.testing.assert_allclose(after["4.weight"], rows, rtol=1e-5)
        history.append((ell, after))
        start = after


def test_the_layers_above_get_the_sites_mean_with_inputs_in_the_matched_order() -> None:
    book = RoundBook()
    start = network(99)
    book.put_global("j", 1, SPEC.to_json(), start)
    uploads = {w: trained(start, 1, seed=k) for k, w in enumerate(WORKERS)}
    after = run_round(book, 1, uploads)
    result = ALIGNMENT.create("nafi", LAYERWISE["alignment_params"]).align(AlignInput(
        clients=[to_layers(SPEC, uploads[w]) for w in WORKERS], weights=np.full(3, 1 / 3),
        rng=np.random.default_rng([0, 1]), class_shares=SHARES, current=to_layers(SPEC, start)))
    sites = [to_layers(SPEC, uploads[w]) for w in WORKERS]
    moved = [scatter_inputs(net[1], result.permutations[k][0], result.widths[0]) for k, net in enumerate(sites)]
    np.testing.assert_allclose(after["2.weight"], sum(m.weight for m in moved) / 3, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after["4.weight"], sum(net[2].weight for net in sites) / 3, rtol=1e-5, atol=1e-6)


def test_a_site_that_changes_a_frozen_layer_changes_nothing_and_is_counted() -> None:
    book = RoundBook()
    start = network(99)
    book.put_global("j", 2, SPEC.to_json(), start)  # round 2: layer 0 was matched in round 1 and is frozen
    uploads = {w: trained(start, 2, seed=k) for k, w in enumerate(WORKERS)}
    uploads["c"] = {**uploads["c"], "0.weight": uploads["c"]["0.weight"] + 100.0, "0.bias": uploads["c"]["0.bias"] - 5}
    book.open_round("j", 2, WORKERS, deadline=1e12, aggregation=LAYERWISE, seed=0,
                    histograms={w: [1, 1, 1] for w in WORKERS})
    for w, state in uploads.items():
        upload(book, state, w, 2)
    result = book.close("j", 2)
    _, _, after = book.global_model("j")
    np.testing.assert_array_equal(after["0.weight"], start["0.weight"])
    np.testing.assert_array_equal(after["0.bias"], start["0.bias"])
    assert result.stats["alignment_frozen_changed"] == 1.0


def test_a_round_past_the_scheme_is_refused() -> None:
    nafi = ALIGNMENT.create("nafi", {"mode": "layerwise"})
    layers = to_layers(SPEC, network(0))
    with pytest.raises(ValueError, match="past the layer-wise scheme's 3 rounds"):
        nafi.align(AlignInput(clients=[layers, layers], weights=np.ones(2), rng=np.random.default_rng(0),
                              round_index=4, current=layers))
    with pytest.raises(ValueError, match="needs the round's starting global network"):
        nafi.align(AlignInput(clients=[layers, layers], weights=np.ones(2), rng=np.random.default_rng(0)))


def test_a_frozen_layer_with_another_shape_is_refused_naming_the_client() -> None:
    nafi = ALIGNMENT.create("pfnm", {"mode": "layerwise"})
    layers = to_layers(SPEC, network(0))
    wider = [Layer(np.zeros((6, 6)), np.zeros(6)), Layer(np.zeros((4, 6)), np.zeros(4)), layers[2]]
    with pytest.raises(ValueError, match="client 1 layer 0"):
        nafi.align(AlignInput(clients=[layers, wider], weights=np.ones(2), rng=np.random.default_rng(0),
                              round_index=2, current=layers))
