"""Not a package: `coordinator/` is a source root of the `fedbroker` namespace (see docs/architecture.md)."""

raise ImportError("'coordinator' is not importable by its folder name: import fedbroker.coordinator (the folder coordinator/ is a source root)")
