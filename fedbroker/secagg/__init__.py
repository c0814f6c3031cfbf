"""Secure aggregation, SecAgg+ (Bell et al., CCS 2020) for a semi-honest service: it learns only a sum.

Pure kernel code (numpy and pyca `cryptography`, no transport): the worker and the aggregation service
both import it and move its bytes and arrays over whatever wire they use. docs/algorithms.md ("Secure
aggregation") describes the protocol, what the service learns and the threat model.

Public API (stable; the services build on these names):

- `SecAggParams(n_max, threshold, neighbours, bits, clip)`: frozen, checked on construction (no sum of
  n_max inputs can wrap the ring 2^bits). `SecAggParams.choose(n, clip)` picks bits, k and t for n workers;
  `.describe()` is the job's view; `.levels`, `.step`, `.dtype` derive from it.
- `quantise(x, params, rng)` → ring array (clip to ±B, stochastic rounding); `dequantise_sum(ring_sum,
  n_summed, params)` → float sum; `sum_error_bound(params, n)` → (worst case, std) per coordinate.
- `SecAggClient(worker_id, params, round_seed, rng)`, one per worker per round, steps in order:
  `advertise()` → `PublicKeys`; `share_keys(roster)` → {peer: sealed shares, led by the dealer's commitments};
  `open_inbox(inbox)` → {sender: why its shares failed} (before training); `masked_input(weighted_vector,
  excluded)` → ring array; `unmask(survivors, dropped)` → {peer: share bytes}.
- `SecAggServer(params, round_seed, length=None)`: `add_keys(id, keys)`*, `rosters()` → {id: {peer:
  PublicKeys}}; `add_shares(id, {peer: bytes})`*, `inboxes()` → {id: {sender: bytes}}; `exclude(senders)`;
  `add_masked(id, ring array)`*, `unmask_requests()` → {id: UnmaskRequest(survivors, dropped)};
  `add_unmask(id, {peer: bytes})`*, `finish()` → `SecAggResult(total, survivors, dropped, error_max,
  error_std)`. total is Σ over survivors of the weighted inputs; divide by the survivors' Σ w_i.
- Errors: `SecAggError` (out of order, unknown or duplicate sender, wrong length, altered message),
  `TooFewSurvivors` (below the threshold t), `ShareMismatch` (shares inconsistent or a corrupt share),
  `Dishonest` (a ShareMismatch naming `worker_id`: a malformed share message, or a revealed share that is not
  the one its dealer committed to).
- `round_seed` is public bytes (≥ 16) the service picks per round; it seeds the neighbour graph and binds
  every derived key and sealed message to the round.
"""

from fedbroker.secagg.client import SecAggClient
from fedbroker.secagg.crypto import PublicKeys, neighbour_graph, prg
from fedbroker.secagg.errors import Dishonest, SecAggError, ShareMismatch, TooFewSurvivors
from fedbroker.secagg.params import SecAggParams, clipped_count, dequantise_sum, quantise, ring_dtype, sum_error_bound
from fedbroker.secagg.server import SecAggResult, SecAggServer, UnmaskRequest

__all__ = [
    "Dishonest",
    "PublicKeys",
    "SecAggClient",
    "SecAggError",
    "SecAggParams",
    "SecAggResult",
    "SecAggServer",
    "ShareMismatch",
    "TooFewSurvivors",
    "UnmaskRequest",
    "clipped_count",
    "dequantise_sum",
    "neighbour_graph",
    "prg",
    "quantise",
    "ring_dtype",
    "sum_error_bound",
]
