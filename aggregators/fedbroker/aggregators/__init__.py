"""Aggregation: pure algorithms (alignment/, weighting/, selection/, mean.py) and the gRPC service that runs them."""
