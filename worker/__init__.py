"""Not a package: `worker/` is a source root of the `fedbroker` namespace (see docs/architecture.md)."""

raise ImportError("'worker' is not importable by its folder name: import fedbroker.worker (the folder worker/ is a source root)")
