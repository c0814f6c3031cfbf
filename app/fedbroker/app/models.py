"""`fedbroker models list|show`: the catalogue of ready models, each written in the model graph itself.

The catalogue is examples/models/*.yaml in a checkout, installed with the package as `fedbroker.model_catalogue`
(data, no code), so `pip install fedbroker` carries it. Each file holds a `name`, the `task` it is written for,
the `reference` implementation it reproduces (tests/app/test_model_catalogue.py builds each model and compares
it with that reference), a one-line `description`, and the `model:` section to paste into a job.

The figures are computed, never written, by the rule the job's view shows and a site's limits compare with
(fedbroker.graph.shapes.bounds): the parameters from the validated graph, the FLOPs per sample (a multiply-add
counts 2; a library network's counted by torch's FLOP counter on the meta device).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import yaml

from fedbroker.app.status import table
from fedbroker.errors import ConfigError
from fedbroker.job.model_spec import ModelSpec, model_bounds, parameter_shapes, parse_model

FIELDS = ("name", "task", "reference", "description", "model")


def catalogue_folder() -> Path:
    """examples/models, which a wheel or the image installs as `fedbroker.model_catalogue`."""
    spec = importlib.util.find_spec("fedbroker.model_catalogue")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if any(Path(location).glob("*.yaml")):
            return Path(location)
    return Path(__file__).resolve().parents[3] / "examples" / "models"  # a checkout on PYTHONPATH only


@dataclasses.dataclass(frozen=True)
class Entry:
    """One catalogue model: its file's fields, its text and its checked spec."""

    name: str
    task: str
    reference: str
    description: str
    text: str
    spec: ModelSpec

    @property
    def parameters(self) -> int:
        """Trained weights, from the graph."""
        return sum(math.prod(shape) for shape in parameter_shapes(self.spec).values())


def read_entry(path: Path) -> Entry:
    """One file of the catalogue, its model validated as a job's would be (ConfigError naming the file)."""
    text = path.read_text()
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict) or set(raw) != set(FIELDS):
        raise ConfigError(str(path), f"a catalogue file holds exactly {', '.join(FIELDS)}")
    if raw["name"] != path.stem:
        raise ConfigError(f"{path}.name", f"is {raw['name']!r} but the file is {path.name}")
    return Entry(raw["name"], raw["task"], " ".join(str(raw["reference"]).split()), raw["description"], text,
                 parse_model(raw["model"]))


@functools.cache
def entries() -> dict[str, Entry]:
    """Every catalogue model by name, in name order."""
    return {entry.name: entry for entry in map(read_entry, sorted(catalogue_folder().glob("*.yaml")))}


def _size(count: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return str(int(count))


def figures(entry: Entry) -> dict[str, Any]:
    """What `list` and `show` print about one model."""
    return {"name": entry.name, "task": entry.task, "input": list(entry.spec.input_shape),
            "parameters": entry.parameters, "flops": model_bounds(entry.spec).flops, "description": entry.description,
            "reference": entry.reference}


def cmd_list(args: argparse.Namespace) -> int:
    """Every catalogue model, one row each."""
    rows = [figures(entry) for entry in entries().values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(table(["name", "task", "input", "parameters", "FLOPs", "description"],
                [[r["name"], r["task"], "×".join(map(str, r["input"])), _size(r["parameters"]), _size(r["flops"]),
                  r["description"]] for r in rows]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """One model's file as written (its `model:` goes into a job), then its figures."""
    known = entries()
    if args.name not in known:
        raise ConfigError("NAME", f"no catalogue model {args.name!r}; known: {', '.join(known)}")
    entry = known[args.name]
    row = figures(entry)
    print(entry.text.rstrip())
    print(f"\n# parameters: {row['parameters']:,} ({_size(row['parameters'])}); FLOPs per sample: {row['flops']:,} "
          f"({_size(row['flops'])}); input {'×'.join(map(str, row['input']))}; output "
          f"{'×'.join(map(str, entry.spec.output_shape))}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker models ...` under the main parser's subcommands."""
    models = sub.add_parser("models", help="the catalogue of ready models (ResNet, DenseNet, U-Net, LSTM, ...)")
    verbs = models.add_subparsers(dest="verb", required=True)
    listing = verbs.add_parser("list", help="every model: task, input, parameters, FLOPs")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(run=cmd_list)
    show = verbs.add_parser("show", help="one model's graph (paste its model: into a job) and its figures")
    show.add_argument("name", metavar="NAME", help="a name from `fedbroker models list`")
    show.set_defaults(run=cmd_show)
