"""Pretrain the X-ray job's backbone on the SYNTHETIC pretext set, and write the job with the weights' pin.

    .venv/bin/python examples/xray-folders/pretrain.py [--data DIR] [--epochs N]

Nothing can be downloaded here, so the "pretrained" backbone is made by this step, as a data scientist makes
one from public data before a study: the job's own model (job.yaml) with a 4-class head is trained centrally,
without DP (no site's data is involved), on `<data>/pretext` (make_data.py: the same synthetic anatomy from
another seed, each image holding one of four structures), every image going through the job's own
`data.preprocess` (fedbroker.datasets.transforms.prepare), so the backbone sees inputs prepared as the sites will
prepare theirs. 80 % of the pretext images train (SGD, lr 0.1, momentum 0.9, batches of 16; no augmentation: the pretext
set is drawn anew by make_data.py, never scarce), 20 % are held out and their accuracy is printed.

It writes, into `<data>` (examples/xray-folders/data by default):
- `pretrained.safetensors`: the trained backbone, and for the head a fresh draw of the job's 3-finding head
  (the job's seed), so the file holds exactly the job model's tensors, as `model.initial_weights` must;
- `job.yaml`: the shipped job.yaml with `initial_weights.sha256` set to that file's SHA-256. Submit this one.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import load_worker_data
from fedbroker.datasets.transforms import prepare
from fedbroker.job.model_spec import parse_model
from fedbroker.job.pipeline import parse_pipeline
from fedbroker.model import build_model
from fedbroker.weights.start import encode, sha256_hex

HERE = Path(__file__).resolve().parent
PIN = "PINNED-BY-PRETRAIN"
STRUCTURES = 4


def model_section(job: dict[str, Any], outputs: int) -> dict[str, Any]:
    """The job's model without its start weights and freezing, with a head of `outputs` scores."""
    model = copy.deepcopy(job["model"])
    for key in ("initial_weights", "freeze"):
        model.pop(key, None)
    model["nodes"]["head"]["out_features"] = outputs
    return model


def pretext_batches(data: Path, job: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pretext images read as a site reads its folder, each prepared by the job's data section."""
    ds = load_worker_data(WorkerConfig(dataset="images", data=DataSection(
        path=str(data / "pretext" / "images"), labels_csv=str(data / "pretext" / "labels.csv"),
        label_column="structure", labels="class", num_classes=STRUCTURES)))
    pipeline = parse_pipeline(job["data"])
    x = np.stack([prepare(pipeline, ds.x.read([i])[0]) for i in range(len(ds.x))]).astype(np.float32)
    return torch.from_numpy(x), torch.as_tensor(np.asarray(ds.y), dtype=torch.long)


def train(job: dict[str, Any], x: torch.Tensor, y: torch.Tensor, *, epochs: int, seed: int) -> torch.nn.Module:
    model = build_model(parse_model(model_section(job, STRUCTURES)), seed=seed)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=generator)
    cut = int(0.8 * len(x))
    fit, held = order[:cut], order[cut:]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        model.train()
        for batch in torch.randperm(len(fit), generator=generator).split(16):
            loss = torch.nn.functional.cross_entropy(model(x[fit[batch]]), y[fit[batch]])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x[held]).argmax(1) == y[held]).float().mean().item() if len(held) else float("nan")
        print(f"pretext epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, held-out accuracy {accuracy:.3f}")
    return model


def start_weights(job: dict[str, Any], pretrained: torch.nn.Module) -> dict[str, np.ndarray]:
    """The job model's tensors: the pretrained backbone's, and a fresh head drawn with the job's seed."""
    fresh = build_model(parse_model(model_section(job, job["task"]["labels"])), seed=int(job["seed"])).state_dict()
    trained = pretrained.state_dict()
    return {name: (fresh[name] if name.startswith("head.") else trained[name]).detach().numpy()
            for name in fresh}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(HERE / "data"), help="make_data.py's --out")
    parser.add_argument("--job", default=str(HERE / "job.yaml"), help="the job to pretrain for")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = Path(args.data)
    text = Path(args.job).read_text()
    job = yaml.safe_load(text)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    x, y = pretext_batches(data, job)
    blob = encode(start_weights(job, train(job, x, y, epochs=args.epochs, seed=args.seed)))
    (data / "pretrained.safetensors").write_bytes(blob)
    digest = sha256_hex(blob)
    if text.count(PIN) != 1:
        raise SystemExit(f"{args.job}: expected one `sha256: {PIN}` line to pin")
    (data / "job.yaml").write_text(text.replace(PIN, digest))
    print(f"wrote {data / 'pretrained.safetensors'} (sha256 {digest}) and {data / 'job.yaml'}")


if __name__ == "__main__":
    main()
