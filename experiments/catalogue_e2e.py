"""The catalogue's ResNet-18, U-Net 2-D, LSTM classifier and text Transformer, end to end through real processes.

For each model: three sites each get a small synthetic data set made by the recipe below (an .npz file and a
`worker.yaml`), then the aggregation service, the coordinator and the three workers start as separate OS
processes (`fedbroker aggregator|coordinator|worker --config ...`) over the machine's RabbitMQ, under a namespace
of their own that is removed at the end. The job (the catalogue file's `model:` and `task:`, FedAvg, DP on at
every site) is submitted with the CLI, waited for, downloaded with `fedbroker jobs download`, and the download's
README snippet is run as written in a fresh interpreter: its outputs on the first samples of a site's data must
equal the served model's (the coordinator's last checkpoint built with `fedbroker.model.build_model`) to 1e-5.

Every process logs in to the broker as `guest`: one broker user per participant needs a broker node whose users
this run may create (the test suite's private node), and the machine's broker is never reconfigured.

Synthetic recipes (numpy, seeded per site; no download):
- resnet18: 3×32×32 images, 10 classes. Each class has a fixed random 3×4×4 colour pattern, upsampled to 32×32;
  a sample is its class's pattern plus N(0, 0.8) noise per pixel.
- unet2d: 1×64×64 images with synthetic lesion masks. One to three discs (radius 4–10 pixels) per image are the
  lesion (mask 1, background 0); the image is N(0, 0.3) noise plus 1.0 inside the discs, smoothed by a 3×3 mean.
- lstm_classifier: 50 token ids in [0, 1000), 2 classes. Tokens are uniform; a class-1 sequence has 10 of its
  positions replaced by ids from [0, 50) (a "keyword" vocabulary), a class-0 sequence none.
- text_transformer: 64 token ids in [0, 2000), 2 classes, the same rule with 12 positions from [0, 100).

Run: `make experiment-catalogue` or `python -m experiments.catalogue_e2e [--models lstm_classifier ...]`.
Writes experiments/results/catalogue_e2e/catalogue_e2e.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "examples" / "models"
RESULTS = ROOT / "experiments" / "results" / "catalogue_e2e"
SOURCE_ROOTS = (ROOT, ROOT / "coordinator", ROOT / "worker", ROOT / "aggregators", ROOT / "proto", ROOT / "app")
PYTHONPATH = os.pathsep.join(str(root) for root in SOURCE_ROOTS)
AMQP_URL = os.environ.get("FEDBROKER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
SITES = ("site_a", "site_b", "site_c")
TOLERANCE = 1e-5
SAMPLE = 4  # samples the snippet and the served model are compared on


@dataclass(frozen=True)
class Setting:
    """One model's run: the catalogue file, samples per site (train + held-out), the job's training section and
    the site's data keys."""

    name: str
    samples: int
    training: dict[str, Any]
    labels: str = "class"
    num_classes: int = 2
    make: Callable[[np.random.Generator, int], tuple[np.ndarray, np.ndarray]] = field(
        default=lambda rng, n: (np.zeros((n, 1)), np.zeros(n)), repr=False)


def images(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    patterns = np.random.default_rng(1000).normal(size=(10, 3, 4, 4))  # the same classes at every site
    y = rng.integers(0, 10, n)
    x = np.repeat(np.repeat(patterns[y], 8, axis=2), 8, axis=3) + rng.normal(0, 0.8, (n, 3, 32, 32))
    return x.astype(np.float32), y.astype(np.int64)


def lesions(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    yy, xx = np.mgrid[0:64, 0:64]
    masks = np.zeros((n, 64, 64), dtype=np.int64)
    for i in range(n):
        for _ in range(int(rng.integers(1, 4))):
            cy, cx, r = rng.integers(10, 54), rng.integers(10, 54), rng.integers(4, 11)
            masks[i][(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = 1
    raw = masks + rng.normal(0, 0.3, (n, 64, 64))
    padded = np.pad(raw, ((0, 0), (1, 1), (1, 1)), mode="edge")
    smooth = np.mean([padded[:, dy:dy + 64, dx:dx + 64] for dy in range(3) for dx in range(3)], axis=0)
    return smooth[:, None].astype(np.float32), masks


def tokens(length: int, vocab: int, keywords: int, planted: int) -> Callable[[np.random.Generator, int],
                                                                            tuple[np.ndarray, np.ndarray]]:
    def make(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, 2, n)
        x = rng.integers(keywords, vocab, (n, length))
        for i in np.flatnonzero(y == 1):
            x[i, rng.choice(length, planted, replace=False)] = rng.integers(0, keywords, planted)
        return x.astype(np.int64), y.astype(np.int64)
    return make


SETTINGS = {
    "resnet18": Setting("resnet18", 80, {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.05},
                        num_classes=10, make=images),
    "unet2d": Setting("unet2d", 80, {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.05},
                      labels="mask", make=lesions),
    "lstm_classifier": Setting("lstm_classifier", 160, {"rounds": 2, "local_epochs": 1, "batch_size": 16,
                                                        "lr": 0.5}, make=tokens(50, 1000, 50, 10)),
    "text_transformer": Setting("text_transformer", 160, {"rounds": 2, "local_epochs": 1, "batch_size": 16,
                                                          "lr": 0.05}, make=tokens(64, 2000, 100, 12)),
}
TASKS = {"resnet18": "classification", "unet2d": {"type": "segmentation", "classes": 2},
         "lstm_classifier": "classification", "text_transformer": "classification"}


@dataclass
class Row:
    model: str
    parameters: int = 0
    rounds: int = 0
    seconds: float = 0.0
    epsilon: dict[str, float] = field(default_factory=dict)
    metric: str = ""
    final_metric: float | None = None
    download_ok: bool = False
    max_abs_diff: float | None = None
    status: str = ""
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Federation:
    """The aggregation service, the coordinator and the sites' workers, each `python -m fedbroker COMMAND
    --config FILE` in its own process, on the broker under a namespace of their own."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.tmp = tmp
        self.namespace = f"fedbroker-catalogue-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
        self.aggregator, self.coordinator = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
        self.env["PYTHONPATH"] = PYTHONPATH

    def common(self) -> dict[str, Any]:
        return {"log_level": "INFO", "broker": {"url": AMQP_URL, "namespace": self.namespace},
                "aggregator": {"target": self.aggregator}, "coordinator": {"target": self.coordinator}}

    def spawn(self, name: str, command: str, config: dict[str, Any]) -> None:
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = (self.tmp / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen([sys.executable, "-m", "fedbroker", command, "--config", str(path)],
                                                env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp)

    def cli(self, *args: str, timeout: float = 300) -> str:
        done = subprocess.run([sys.executable, "-m", "fedbroker", *args, "--coordinator", self.coordinator],
                              env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.tmp)
        if done.returncode != 0:
            raise RuntimeError(f"fedbroker {' '.join(args)}: {done.stderr.strip()}\n{done.stdout}")
        return done.stdout

    def alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.alive()
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}\n{self.logs()}")

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
        from fedbroker.bus import delete_topology

        delete_topology(AMQP_URL, namespace=self.namespace, worker_ids=list(SITES))


def catalogue_entry(name: str) -> dict[str, Any]:
    entry: dict[str, Any] = yaml.safe_load((CATALOGUE / f"{name}.yaml").read_text())
    return entry


def write_site_data(setting: Setting, tmp: Path) -> dict[str, Path]:
    paths = {}
    for i, site in enumerate(SITES):
        x, y = setting.make(np.random.default_rng(100 + i), setting.samples)
        paths[site] = tmp / f"{site}.npz"
        np.savez(paths[site], x=x, y=y)
    return paths


def worker_config(fed: Federation, setting: Setting, site: str, data: Path) -> dict[str, Any]:
    return {**fed.common(), "worker": {
        "id": site, "categories": [f"catalogue-{setting.name}"], "dataset": "npz",
        "data": {"path": str(data), "labels": setting.labels, "num_classes": setting.num_classes},
        "ledger_path": str(fed.tmp / f"{site}-ledger.json"), "device": "cpu", "heartbeat_s": 1.0,
        "torch_threads": 1, "test_fraction": 0.2,
        "dp": {"enabled": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5,
               "epsilon_budget": 100.0}}}


def job_for(setting: Setting, sites: int = len(SITES)) -> dict[str, Any]:
    """The job: the catalogue file's model, the model's task, FedAvg over `sites` sites."""
    entry = catalogue_entry(setting.name)
    return {"name": f"catalogue-{setting.name}", "category": f"catalogue-{setting.name}", "seed": 7,
            "model": entry["model"], "task": TASKS[setting.name], "training": setting.training,
            "aggregation": {"alignment": "none", "weighting": "fedavg", "selection": "all"},
            "evaluation": {"every": 1, "sites": "category"},
            "schedule": {"min_workers": sites, "wait_for_workers_s": 300, "round_timeout_s": 1500}}


def served_outputs(state_dir: Path, job_id: str, x: np.ndarray) -> np.ndarray:
    """The served model: the coordinator's last checkpoint of the job, built as the coordinator builds it."""
    import torch

    from fedbroker.job.spec import parse_model
    from fedbroker.model import build_model, load_numpy_state

    (path,) = sorted(state_dir.rglob(f"{job_id}/round-*.safetensors"))[-1:]
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        spec_json = (fh.metadata() or {})["model_spec_json"]
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 (a reader, not a dict)
    model = build_model(parse_model(json.loads(spec_json)))
    load_numpy_state(model, tensors)
    model.eval()
    with torch.no_grad():
        return np.asarray(model(torch.from_numpy(x.astype(np.float32))).numpy())


def snippet_outputs(folder: Path, x: np.ndarray) -> np.ndarray:
    """The README's snippet as written, in a fresh interpreter in the download's folder, then the model on x."""
    readme = (folder / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    np.save(folder / "sample.npy", x.astype(np.float32))
    script = snippet + ("\nimport numpy as np, torch\nwith torch.no_grad():\n"
                        "    np.save('out.npy', model(torch.from_numpy(np.load('sample.npy'))).numpy())\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=folder, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    if run.returncode != 0:
        raise RuntimeError(f"the README snippet failed:\n{run.stderr[-3000:]}")
    return np.asarray(np.load(folder / "out.npy", allow_pickle=False))


def run_model(setting: Setting, tmp: Path) -> Row:
    row = Row(setting.name, rounds=int(setting.training["rounds"]))
    fed = Federation(tmp, setting.name)
    try:
        data = write_site_data(setting, tmp)
        fed.spawn("aggregator", "aggregator", {**fed.common(), "aggregator": {
            "listen": fed.aggregator, "target": fed.aggregator, "spool_dir": str(tmp / "spool")}})
        fed.spawn("coordinator", "coordinator", {**fed.common(), "coordinator": {
            "listen": fed.coordinator, "target": fed.coordinator, "state_dir": str(tmp / "state")}})
        for site in SITES:
            fed.spawn(site, "worker", worker_config(fed, setting, site, data[site]))

        def registered() -> bool:
            try:
                return len(json.loads(fed.cli("status", "--json"))["workers"]) == len(SITES)
            except RuntimeError:  # the coordinator is still starting
                return False

        fed.wait(registered, 300, "the sites to register")
        job_file = tmp / "job.json"
        job_file.write_text(json.dumps(job_for(setting)))
        started = time.monotonic()
        submitted = json.loads(fed.cli("submit", str(job_file), "--json"))
        job_id, row.parameters = submitted["job_id"], int(submitted["model_bounds"]["parameters"])

        def finished() -> dict[str, Any] | None:
            doc: dict[str, Any] = json.loads(fed.cli("jobs", "show", job_id, "--json"))
            return doc if doc["status"] in ("completed", "failed", "cancelled") else None

        doc = fed.wait(finished, 3600, "the job to end")
        row.seconds = round(time.monotonic() - started, 1)
        row.status = doc["status"]
        if doc["status"] != "completed":
            raise RuntimeError(f"job {doc['status']}: {doc.get('error')}\n{fed.logs()}")
        for p in doc["participants"]:
            if p["status"] == "aggregated":
                row.epsilon[p["worker_id"]] = round(max(row.epsilon.get(p["worker_id"], 0.0), p["epsilon"]), 3)
        last = doc["rounds"][-1]
        row.metric, row.final_metric = last.get("federated_metric") or "", last.get("federated_accuracy")
        out = tmp / "download"
        fed.cli("jobs", "download", job_id, "--out", str(out))
        x = np.load(data[SITES[0]], allow_pickle=False)["x"][:SAMPLE]
        got, expected = snippet_outputs(out, x), served_outputs(tmp / "state", job_id, x)
        row.max_abs_diff = float(np.max(np.abs(got - expected))) if got.shape == expected.shape else None
        row.download_ok = row.max_abs_diff is not None and bool(np.allclose(got, expected, rtol=TOLERANCE,
                                                                            atol=TOLERANCE))
    except Exception as exc:  # a model that fails is a row of the table, with why
        row.error = str(exc)[-4000:]
    finally:
        fed.close()
    return row


def table(rows: list[Row]) -> str:
    lines = ["| model | parameters | rounds | seconds | ε spent per site | final metric | download ok |",
             "|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        eps = ", ".join(f"{s} {e:.2f}" for s, e in sorted(r.epsilon.items())) or "-"
        metric = f"{r.metric} {r.final_metric:.3f}" if r.final_metric is not None else "-"
        ok = ("yes" if r.download_ok else "NO") + (f" (max diff {r.max_abs_diff:.1e})"
                                                    if r.max_abs_diff is not None else "")
        lines.append(f"| {r.model} | {r.parameters:,} | {r.rounds} | {r.seconds:.0f} | {eps} | {metric} | {ok} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="catalogue-e2e-") as tmp:
        for name in tqdm(args.models, desc="catalogue models end to end", unit="model"):
            folder = Path(tmp) / name
            folder.mkdir()
            rows.append(run_model(SETTINGS[name], folder))
            tqdm.write(f"{name}: {rows[-1].status or 'failed'} in {rows[-1].seconds:.0f} s"
                       + (f" — {rows[-1].error.splitlines()[0]}" if rows[-1].error else ""))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    text = ("# Catalogue models end to end\n\n"
            "Coordinator, aggregation service and 3 workers as separate processes over RabbitMQ (guest), DP on at "
            "every site (noise multiplier 1.0, clip 1.0, δ 1e-5), FedAvg; synthetic data per site "
            "(experiments/catalogue_e2e.py). Seconds: submission to completion. Download ok: the README snippet, "
            f"run in a fresh interpreter, gives the served model's outputs to {TOLERANCE:g}.\n\n"
            f"Machine: {machine}.\n\n" + table(rows))
    errors = [f"- {r.model}: {r.error.splitlines()[0] if r.error else ''}" for r in rows if r.error]
    if errors:
        text += "\nFailures:\n\n" + "\n".join(errors) + "\n"
    (out / "catalogue_e2e.md").write_text(text)
    (out / "catalogue_e2e.json").write_text(json.dumps({"machine": machine, "rows": [asdict(r) for r in rows],
                                                        "settings": {n: {"samples_per_site": s.samples,
                                                                         "training": s.training}
                                                                     for n, s in SETTINGS.items()}}, indent=2))
    print(text)
    if errors:
        for r in rows:
            if r.error:
                print(f"=== {r.model}\n{r.error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
