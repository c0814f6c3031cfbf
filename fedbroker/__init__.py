"""fedbroker: federated learning over RabbitMQ and gRPC with per-data-owner differential privacy."""

__version__ = "0.1.0"
