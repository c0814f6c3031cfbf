"""Privacy audit (FL-DMX's evaluation): a membership-inference attack on a run's final global model.

The loss-threshold attack (Yeom et al.) guesses "member" when a sample's loss is low: its AUC over
members (the workers' training data) vs non-members (the held-out test split) measures how much the
model gives away about who was in the training set. 0.5 means nothing; DP should push it toward 0.5.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fedbroker.app.demo import DemoOptions


def per_sample_loss(spec_json: str, tensors: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each sample's cross-entropy under the checkpoint's model: the attack's score, before any threshold."""
    import torch

    from fedbroker.job.spec import parse_model
    from fedbroker.model import build_model, load_numpy_state

    model = build_model(parse_model(json.loads(spec_json)))
    load_numpy_state(model, tensors)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        return torch.nn.functional.cross_entropy(logits, torch.from_numpy(y), reduction="none").numpy()


def loss_threshold_auc(member_loss: np.ndarray, nonmember_loss: np.ndarray) -> float:
    """ROC AUC of the score −loss for telling members from non-members (threshold-free)."""
    from sklearn.metrics import roc_auc_score

    labels = np.concatenate([np.ones(len(member_loss)), np.zeros(len(nonmember_loss))])
    return float(roc_auc_score(labels, -np.concatenate([member_loss, nonmember_loss])))


def attack_run(run_dir: Path) -> dict[str, Any]:
    """Attack the last checkpoint of a demo run: members are the training split the workers were dealt."""
    from fedbroker.coordinator.checkpoints import checkpoints_of, load_checkpoint
    from fedbroker.datasets import load_dataset, train_test_split

    results = json.loads((run_dir / "results.json").read_text())
    checkpoints = checkpoints_of(run_dir / "coordinator" / "checkpoints", results["job_id"])
    if not checkpoints:
        raise FileNotFoundError(f"no checkpoint under {run_dir}/coordinator/checkpoints")
    tensors, spec_json = load_checkpoint(checkpoints[-1])
    data = load_dataset(results["options"]["dataset"])
    train, test = train_test_split(data, test_fraction=0.2, seed=0)
    members = per_sample_loss(spec_json, tensors, train.x, train.y)
    nonmembers = per_sample_loss(spec_json, tensors, test.x, test.y)
    return {
        "attack_auc": round(loss_threshold_auc(members, nonmembers), 4),
        "member_loss": round(float(members.mean()), 4),
        "nonmember_loss": round(float(nonmembers.mean()), 4),
        "test_accuracy": results["summary"]["final_accuracy"],
        "max_epsilon": results["summary"]["max_epsilon"],
    }


def run_audit(options: DemoOptions, out: Path) -> dict[str, Any]:
    """The same federation with and without DP, each attacked; writes audit.md and audit.json under `out`."""
    from fedbroker.app.demo import run_demo

    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for dp in (False, True):
        run = replace(options, dp=dp, run_id=f"{options.run_id}-{'dp' if dp else 'nodp'}", out=str(out))
        run_demo(run)
        rows["with DP" if dp else "without DP"] = attack_run(out / run.run_id)
    report = {"options": {k: v for k, v in vars(options).items() if k not in ("broker", "run_id", "out")},
              "results": rows}
    (out / "audit.json").write_text(json.dumps(report, indent=2))
    (out / "audit.md").write_text(render(report))
    print(render(report))
    return report


def render(report: dict[str, Any]) -> str:
    """The audit as a Markdown table (audit.md, and what the command prints)."""
    o = report["options"]
    lines = [
        "# Membership-inference audit (loss-threshold attack)",
        "",
        f"{o['workers']} workers, {o['dataset']} ({o['partition']}, α={o['alpha']}), {o['rounds']} rounds × "
        f"{o['local_epochs']} local epochs, MLP hidden {o['hidden']}; DP: σ={o['noise_multiplier']}, "
        f"clip={o['max_grad_norm']}, δ={o['delta']}. Members: the training split the workers hold; "
        "non-members: the held-out test split. AUC 0.5 = the attack learns nothing.",
        "",
        "| run | attack AUC | mean member loss | mean non-member loss | test accuracy | max ε |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        eps = f"{r['max_epsilon']:.2f}" if r["max_epsilon"] is not None else "∞ (no DP)"
        lines.append(f"| {name} | {r['attack_auc']:.4f} | {r['member_loss']:.4f} | {r['nonmember_loss']:.4f} | "
                     f"{r['test_accuracy']:.4f} | {eps} |")
    return "\n".join(lines) + "\n"
