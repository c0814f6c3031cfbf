"""A data owner's worker: task consumer, local data, DP training under the owner's own policy, ε ledger."""
