"""gRPC as both services and their clients speak it: errors to status codes, limits and deadlines (`plumbing`),
the chunked tensor codec, call guards, tokens and live-reloaded credentials, and the aggregation client."""
