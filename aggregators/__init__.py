"""Not a package: `aggregators/` is a source root of the `fedbroker` namespace (see docs/architecture.md)."""

raise ImportError("'aggregators' is not importable by its folder name: import fedbroker.aggregators (the folder aggregators/ is a source root)")
