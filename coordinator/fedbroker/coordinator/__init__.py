"""The coordinator: job intake, worker registry, round scheduler, durable state and checkpoints."""
