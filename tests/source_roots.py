"""Where the `fedbroker` namespace lives in a checkout: the kernel at the root, each service in its folder.

A test that starts a fresh interpreter on the checkout (as if installed) puts these on its PYTHONPATH.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = (ROOT, ROOT / "coordinator", ROOT / "worker", ROOT / "aggregators", ROOT / "proto", ROOT / "app")
PYTHONPATH = os.pathsep.join(str(root) for root in SOURCE_ROOTS)
