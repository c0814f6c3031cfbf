"""The algorithms' catalogue and their typed parameters: what a job may name and how each name is checked, kept
apart from the arithmetic (which lives in the aggregation service)."""
