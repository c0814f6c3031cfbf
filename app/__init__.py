"""Not a package: `app/` is a source root of the `fedbroker` namespace: the face, `fedbroker.app` (see
docs/architecture.md)."""

raise ImportError("'app' is not importable by its folder name: import fedbroker.app (the folder app/ is a source root)")
