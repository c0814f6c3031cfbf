"""fedbroker: federated learning over RabbitMQ and gRPC with per-data-owner differential privacy.

One installed namespace, four rooms:
- the kernel, here (`fedbroker/*.py`, `fedbroker/bus/`): what every process shares — job and model specs,
  process config, the tensor codec, gRPC helpers, auth, the bus, metrics helpers. It imports no service.
- the services, whose homes are the repository's top-level folders: `fedbroker.coordinator`
  (`coordinator/`), `fedbroker.worker` (`worker/`), `fedbroker.aggregators` (`aggregators/`: pure
  algorithms plus the aggregation service) and the contract `fedbroker.proto` (`proto/`).
- the face, `fedbroker.app`: the `fedbroker` command, process launchers, the demo, the audit.
"""

__version__ = "0.1.0"
