"""FLTrust's root update g_0: the service's own training step from the global model on its root (probe) set.

The robust rule itself is pure numpy and takes g_0 as an argument (`robust.bounded.FLTrust`); this is the one
place the aggregation service runs torch, imported only when a job names `fltrust`. The root set is a probe
set the service holds (`aggregators.probe_sets`: public data, never a worker's). Training is plain SGD with
cross-entropy in train mode, seeded by the job's seed and the round, without touching torch's
global random state.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedbroker.job.spec import ModelSpec


def train_root_update(spec: ModelSpec, state: Mapping[str, np.ndarray], x: np.ndarray, y: np.ndarray, *,
                      epochs: int, lr: float, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    """g_0 = (the global model after `epochs` of SGD on (x, y)) − the global model, tensor by tensor."""
    import torch  # the aggregation service needs torch only for this

    from fedbroker.model import build_model, load_numpy_state, state_to_numpy

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(spec)
        load_numpy_state(model, state)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        inputs = torch.as_tensor(np.asarray(x, dtype=np.float32))
        labels = torch.as_tensor(np.asarray(y, dtype=np.int64))
        for _ in range(epochs):
            order = torch.randperm(len(labels))
            for start in range(0, len(labels), batch_size):
                batch = order[start:start + batch_size]
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(inputs[batch]), labels[batch])
                loss.backward()
                optimizer.step()
        trained = state_to_numpy(model)
    return {name: trained[name] - np.asarray(state[name], dtype=np.float32) for name in state}
