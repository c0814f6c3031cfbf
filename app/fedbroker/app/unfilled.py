"""A site's kit made without data settings: its worker.yaml says `FILL-IN` where the data goes, and the worker
refuses to start until every one of those is filled in.

Without this, a kit for a site that project.yaml lists with no `worker` settings would start on the default
data set (scikit-learn's digits) and train a federation's job on it as if it were the site's data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fedbroker.config import PLACEHOLDER
from fedbroker.errors import ConfigError

FILL_IN = PLACEHOLDER
DATA_KEYS = ("dataset", "idx_dir", "data")  # a site's worker settings that name its data

HOW = ("set worker.dataset to csv, npz or parquet with worker.data.path (and data.label_column, "
       "data.feature_columns, data.classes as your file needs), or to idx with worker.idx_dir, or to a bundled set "
       "(digits, breast_cancer, wine, iris) for a trial, and delete any FILL-IN left that does not apply")


def names_no_data(worker: Mapping[str, Any]) -> bool:
    """Whether a site's worker settings in project.yaml leave its data unnamed."""
    return not any(key in worker for key in DATA_KEYS)


def placeholders() -> dict[str, Any]:
    """The worker settings a kit writes for a site whose data is not named: every one FILL-IN."""
    return {"dataset": FILL_IN, "data": {"path": FILL_IN}}


HEADER = (f"# TO FILL IN before the first start: your data. `worker.dataset` and `worker.data.path` say {FILL_IN}\n"
          f"# (project.yaml named no data for this site) and `fedbroker worker` refuses to start while any {FILL_IN}\n"
          f"# is left: {HOW}.\n")


def unfilled(section: Any, prefix: str = "worker") -> list[str]:
    """The dotted names of the settings in a (config dataclass) section still set to FILL-IN."""
    out: list[str] = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        name = f"{prefix}.{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += unfilled(value, name)
        elif value == FILL_IN or (isinstance(value, tuple) and FILL_IN in value):
            out.append(name)
    return out


def refuse_unfilled(worker: Any, source: str) -> None:
    """ConfigError naming `source` (the config file) and every FILL-IN left in its worker section."""
    left = unfilled(worker)
    if left:
        raise ConfigError(source, f"the site's data is not filled in yet: {', '.join(left)} still say {FILL_IN}; "
                                  f"{HOW} (or set them with FEDBROKER__WORKER__... variables)")
