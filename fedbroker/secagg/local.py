"""One whole SecAgg+ round in one process: every message passes through the server object as it would
over the wire. For tests, the benchmark and anyone checking the protocol without a network."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedbroker.secagg.client import SecAggClient
from fedbroker.secagg.params import SecAggParams
from fedbroker.secagg.server import SecAggResult, SecAggServer


def run_round(inputs: Mapping[str, NDArray[np.floating[Any]]], params: SecAggParams, round_seed: bytes, *,
              rng: np.random.Generator, drop_before_sharing: Collection[str] = (),
              drop_before_masking: Collection[str] = (), drop_before_unmask: Collection[str] = ()) -> SecAggResult:
    """Σ of the (already weighted) inputs of the workers that survive, with dropouts at each stage.

    drop_before_sharing: advertise keys, then vanish; drop_before_masking: share keys, then vanish;
    drop_before_unmask: send a masked input, then never answer the unmask request.
    """
    server = SecAggServer(params, round_seed)
    clients = {w: SecAggClient(w, params, round_seed, rng) for w in inputs}
    for w, client in clients.items():
        server.add_keys(w, client.advertise())
    rosters = server.rosters()
    for w in set(clients) - set(drop_before_sharing):
        server.add_shares(w, clients[w].share_keys(rosters[w]))
    inboxes = server.inboxes()
    failed = {sender for w, box in inboxes.items() for sender in clients[w].open_inbox(box)}
    server.exclude(failed)
    for w in sorted(set(inboxes) - failed):
        if w not in drop_before_masking:
            server.add_masked(w, clients[w].masked_input(inputs[w], failed))
    for w, request in server.unmask_requests().items():
        if w not in drop_before_unmask:
            server.add_unmask(w, clients[w].unmask(request.survivors, request.dropped))
    return server.finish()
