"""Not a package: `proto/` is a source root of the `fedbroker` namespace (see docs/architecture.md)."""

raise ImportError("'proto' is not importable by its folder name: import fedbroker.proto (the folder proto/ is a source root)")
