"""The fedbroker version this process runs: `fedbroker --version` prints it, and a worker's registration carries
it, so an operator sees which sites run which release (`fedbroker sites list`)."""

from __future__ import annotations

import importlib.metadata

NOT_INSTALLED = "unknown (not installed)"


def installed_version() -> str:
    """The installed distribution's version: the namespace package has no `__init__` to hold a `__version__`."""
    try:
        return importlib.metadata.version("fedbroker")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        return NOT_INSTALLED
