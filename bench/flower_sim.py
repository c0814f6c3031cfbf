"""Flower's simulation of N trivial clients (run by bench.control_plane inside `.venv-bench`).

`python -m bench.flower_sim N ROUNDS OUT.json`: FedAvg over every client each round, each client
returning its 10 parameters + 0.01 with no training; per-round seconds from `configure_fit` to the end
of `aggregate_fit`, measured inside the strategy.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np


def main() -> None:
    count, rounds, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import flwr
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)
    starts: dict[int, float] = {}
    seconds: list[float] = []
    results: list[int] = []

    class Trivial(NumPyClient):  # type: ignore[misc]
        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [p + np.float32(0.01) for p in parameters], 100, {}

    class Timed(FedAvg):  # type: ignore[misc]
        def configure_fit(self, server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
            starts[server_round] = time.perf_counter()
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results_, failures):  # type: ignore[no-untyped-def]
            out_ = super().aggregate_fit(server_round, results_, failures)
            seconds.append(time.perf_counter() - starts[server_round])
            results.append(len(results_))
            return out_

    def server_fn(context):  # type: ignore[no-untyped-def]
        strategy = Timed(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=count, min_available_clients=count,
                         initial_parameters=ndarrays_to_parameters([np.zeros(10, np.float32)]))
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))

    run_simulation(server_app=ServerApp(server_fn=server_fn),
                   client_app=ClientApp(client_fn=lambda context: Trivial().to_client()),
                   num_supernodes=count, backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    with open(out, "w") as f:
        json.dump({"version": flwr.__version__, "rounds": seconds, "results": results}, f)


if __name__ == "__main__":
    main()
