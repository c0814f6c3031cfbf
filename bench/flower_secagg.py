"""Flower's SecAgg+ round in one process (run by bench.secagg inside `.venv-bench`).

`python -m bench.flower_secagg N P DROPOUT SHARES THRESHOLD REPEATS OUT.json`

The client side is Flower's own code: `secaggplus_mod`'s stage functions (`_setup`, `_share_keys`,
`_collect_masked_vectors`, `_unmask`), called with the configs its messages would carry. The server side
is a line-by-line transcript of `SecAggPlusWorkflow`'s stage bodies (routing, `parameters_addition`,
`parameters_mod`, `combine_shares`, `pseudo_rand_gen`, `dequantize`) without the messaging, because the
workflow methods need a live Grid. Dropped workers share keys and then send no masked vector, as in
bench.secagg. Inputs are already weighted: every client reports num_examples = max_weight (ratio 1), so
Flower's result is the survivors' mean; it is multiplied back by the survivor count to compare sums.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import numpy as np


def one_round(n: int, p: int, dropout: float, shares: int, threshold: int, seed: int) -> dict[str, Any]:
    from flwr.client.mod.secure_aggregation.secaggplus_mod import (
        SecAggPlusState,
        _collect_masked_vectors,
        _setup,
        _share_keys,
        _unmask,
    )
    from flwr.common import bytes_to_ndarray, ndarrays_to_parameters
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.common.secure_aggregation.ndarrays_arithmetic import (
        factor_extract,
        get_parameters_shape,
        parameters_addition,
        parameters_mod,
        parameters_subtraction,
    )
    from flwr.common.secure_aggregation.quantization import dequantize
    from flwr.common.secure_aggregation.secaggplus_constants import Key
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    rng = np.random.default_rng(seed)
    np.random.seed(seed)  # Flower's stochastic rounding draws from the global generator
    random.seed(seed)
    clip, target, mod = 1.0 / n, 1 << 22, 1 << 32  # Flower's defaults for the ranges; B as bench.secagg's
    inputs = {nid: (rng.uniform(-0.9, 0.9, p) / n).astype(np.float32) for nid in range(1, n + 1)}  # inside ±B
    params = {nid: ndarrays_to_parameters([x]) for nid, x in inputs.items()}
    dead = set(rng.choice(sorted(inputs), round(dropout * n), replace=False).tolist()) if dropout else set()
    client_s, server_s = 0.0, 0.0

    t0 = time.perf_counter()
    nids = sorted(inputs)
    random.shuffle(nids)
    half = shares >> 1
    neighbours = {nid: {nids[(i + o) % n] for o in range(-half, half + 1)} for i, nid in enumerate(nids)}
    server_s += time.perf_counter() - t0

    states = {nid: SecAggPlusState(nid=nid) for nid in inputs}
    setup = {Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: shares, Key.THRESHOLD: threshold, Key.CLIPPING_RANGE: clip,
             Key.TARGET_RANGE: target, Key.MOD_RANGE: mod, Key.MAX_WEIGHT: 1.0}
    t0 = time.perf_counter()
    keys = {nid: _setup(states[nid], dict(setup)) for nid in inputs}
    client_s += time.perf_counter() - t0

    t0 = time.perf_counter()
    sent = {}
    for nid in inputs:
        sent[nid] = _share_keys(states[nid], {str(j): [keys[j][Key.PUBLIC_KEY_1], keys[j][Key.PUBLIC_KEY_2]]
                                              for j in neighbours[nid]})
    client_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    fwd_ct: dict[int, list[bytes]] = {nid: [] for nid in inputs}
    fwd_src: dict[int, list[int]] = {nid: [] for nid in inputs}
    for src, res in sent.items():
        for dst, ct in zip(res[Key.DESTINATION_LIST], res[Key.CIPHERTEXT_LIST]):
            fwd_ct[dst].append(ct)
            fwd_src[dst].append(src)
    server_s += time.perf_counter() - t0

    masked_vector = None
    active = set(inputs) - dead
    for nid in sorted(active):
        t0 = time.perf_counter()
        res = _collect_masked_vectors(states[nid], {Key.CIPHERTEXT_LIST: fwd_ct[nid], Key.SOURCE_LIST: fwd_src[nid]},
                                      1, params[nid])
        t1 = time.perf_counter()
        vec = [bytes_to_ndarray(b) for b in res[Key.MASKED_PARAMETERS]]
        masked_vector = vec if masked_vector is None else parameters_addition(masked_vector, vec)
        server_s += time.perf_counter() - t1
        client_s += t1 - t0
    t0 = time.perf_counter()
    masked_vector = parameters_mod(masked_vector, mod)
    server_s += time.perf_counter() - t0

    collected: dict[int, list[bytes]] = {nid: [] for nid in inputs}
    for nid in sorted(active):
        t0 = time.perf_counter()
        res = _unmask(states[nid], {Key.ACTIVE_NODE_ID_LIST: list(neighbours[nid] & active),
                                    Key.DEAD_NODE_ID_LIST: list(neighbours[nid] & dead)})
        client_s += time.perf_counter() - t0
        for owner, share in zip(res[Key.NODE_ID_LIST], res[Key.SHARE_LIST]):
            collected[owner].append(share)

    t0 = time.perf_counter()
    for nid, share_list in collected.items():
        if len(share_list) < threshold:
            raise RuntimeError(f"node {nid}: {len(share_list)} shares < threshold {threshold}")
        secret = combine_shares(share_list)
        if nid in active:
            mask = pseudo_rand_gen(secret, mod, get_parameters_shape(masked_vector))
            masked_vector = parameters_subtraction(masked_vector, mask)
        else:
            for other in neighbours[nid] - {nid}:
                shared = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(keys[other][Key.PUBLIC_KEY_1]))
                mask = pseudo_rand_gen(shared, mod, get_parameters_shape(masked_vector))
                if nid > other:
                    masked_vector = parameters_addition(masked_vector, mask)
                else:
                    masked_vector = parameters_subtraction(masked_vector, mask)
    recon = parameters_mod(masked_vector, mod)
    q_total, recon = factor_extract(recon)
    out = dequantize(recon, clip, target)[0]
    out = (out - (len(active) - 1) * clip) * (target / q_total)
    server_s += time.perf_counter() - t0
    plain = np.sum([inputs[nid].astype(np.float64) for nid in sorted(active)], axis=0)
    error = out * len(active) - plain
    return {"client_s": client_s, "server_s": server_s, "total_s": client_s + server_s,
            "max_abs_error": float(np.abs(error).max()), "error_std": float(error.std()), "survivors": len(active)}


def main() -> None:
    n, p, dropout, shares, threshold, repeats, out = (int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]),
                                                      int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7])
    import flwr

    runs = [one_round(n, p, dropout, shares, threshold, seed) for seed in range(repeats)]
    with open(out, "w") as f:
        json.dump({"version": flwr.__version__, "runs": runs}, f)


if __name__ == "__main__":
    main()
