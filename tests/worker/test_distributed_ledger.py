"""A site's ledger and budget in distributed-DP jobs (worker/ledger.py, worker/budget.py, `fedbroker ledger`): both
figures kept per job and recomputable from the recorded rounds alone, the distributed one checked against the owner's
budget, older ledgers still read."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.config import DPPolicy
from fedbroker.errors import BudgetExceeded, ConfigError
from fedbroker.secagg import skellam
from fedbroker.worker.budget import SiteBudget, distributed_figures
from fedbroker.worker.ledger import DistributedRound, PrivacyLedger


def a_round(number: int = 1, *, mu: float | None = None, mode: str = "distributed") -> DistributedRound:
    scale, z, clip, quorum = 400.0, 1.0, 1.0, 3
    full = (scale * z * clip) ** 2
    return DistributedRound(round=number, scale=scale, dim=30, clip=clip, noise_multiplier=z, sample_rate=0.05,
                            quorum=quorum, mu=full / quorum if mu is None else mu, bits=40, delta=1e-5, mode=mode)


def recompute(raw: list[dict]) -> tuple[float, float]:
    """Both figures from the ledger file's numbers alone, through the accountant's own functions."""
    together, alone = np.zeros(len(skellam.ORDERS)), np.zeros(len(skellam.ORDERS))
    for r in raw:
        full = (r["scale"] * r["noise_multiplier"] * r["clip"]) ** 2
        settings = skellam.DDPRound(scale=r["scale"], share_variance=full / r["quorum"], full_variance=full,
                                    bits=r["bits"], wrap_probability=0.0, quorum=r["quorum"], dim=r["dim"],
                                    clip=r["clip"], noise_multiplier=r["noise_multiplier"],
                                    sample_rate=r["sample_rate"])
        together += skellam.round_rdp(round=settings, variance=max(full, r["mu"]))
        alone += skellam.round_rdp(round=settings, variance=r["mu"])
    delta = raw[-1]["delta"]
    return (skellam.rdp_to_epsilon(skellam.ORDERS, together, delta=delta)[0],
            skellam.rdp_to_epsilon(skellam.ORDERS, alone, delta=delta)[0])


def test_both_figures_are_kept_and_recomputed_from_the_recorded_parameters(tmp_path) -> None:
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(str(path), worker_id="a")
    rounds = [a_round(1), a_round(2, mu=(400.0 ** 2) * 0.5)]   # the second raised by a floor
    for i in range(len(rounds)):
        distributed, floor = distributed_figures(rounds[: i + 1])
        ledger.record_distributed("job-d", step=rounds[i], epsilon=distributed, floor_epsilon=floor)
    doc = json.loads(path.read_text())
    assert doc["version"] == 2
    raw = doc["jobs"]["job-d"]["distributed"]["rounds"]
    assert [r["round"] for r in raw] == [1, 2] and raw[1]["mu"] == 80000.0
    distributed, floor = recompute(raw)
    assert doc["jobs"]["job-d"]["epsilon"] == pytest.approx(distributed, rel=1e-12)
    assert doc["jobs"]["job-d"]["distributed"]["floor_epsilon"] == pytest.approx(floor, rel=1e-12)
    assert floor > distributed > 0          # one share is less noise than a quorum's
    # a distributed-mode share at z/√3 alone: its own guarantee is that of z/√3 noise, far weaker
    assert floor > 2 * distributed
    reopened = PrivacyLedger(str(path), worker_id="a")
    assert reopened.distributed_rounds("job-d") == rounds
    assert reopened.floors() == {"job-d": pytest.approx(floor)}
    assert reopened.total_epsilon() == pytest.approx(distributed)   # the budget counts the distributed figure
    with pytest.raises(ConfigError, match="refusing to record less"):
        reopened.record_distributed("job-d", step=a_round(3), epsilon=distributed / 2, floor_epsilon=floor)


def test_a_local_mode_share_is_the_whole_dose_and_its_floor_is_its_distributed_figure() -> None:
    full = 400.0 ** 2
    distributed, floor = distributed_figures([a_round(1, mu=full, mode="local")])
    quorum_only, share_only = distributed_figures([a_round(1)])
    assert floor == pytest.approx(distributed, rel=1e-12)    # alone it carries what a quorum of shares carries
    assert distributed == pytest.approx(quorum_only, rel=1e-12) and share_only > 2 * quorum_only


def test_a_distributed_round_past_the_owners_budget_is_refused_counting_the_other_jobs(tmp_path) -> None:
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"), worker_id="a")
    cost, _ = distributed_figures([a_round(1)])
    budget = SiteBudget(worker_id="a", ledger=ledger, dp=DPPolicy(epsilon_budget=cost * 1.5), num_samples=100)
    assert budget.check_distributed("job-d", a_round(1))[0] == pytest.approx(cost)
    ledger.record("job-other", history=[(1.0, 0.1, 10)], epsilon=cost)
    with pytest.raises(BudgetExceeded, match=r"other jobs"):
        budget.check_distributed("job-d", a_round(1))
    assert ledger.distributed_rounds("job-d") == []


def test_the_heartbeat_prices_a_distributed_jobs_next_round_as_its_last(tmp_path) -> None:
    from fedbroker.job.spec import TrainingConfig

    ledger = PrivacyLedger(str(tmp_path / "ledger.json"), worker_id="a")
    budget = SiteBudget(worker_id="a", ledger=ledger, dp=DPPolicy(epsilon_budget=100.0), num_samples=100)
    budget.note_job("job-d", TrainingConfig(), distributed=True)
    assert not budget.heartbeat(state="idle").job_costs[0].known   # its settings come with its first roster
    first, floor = distributed_figures([a_round(1)])
    ledger.record_distributed("job-d", step=a_round(1), epsilon=first, floor_epsilon=floor)
    cost = budget.heartbeat(state="idle").job_costs[0]
    assert cost.known and cost.next_round_epsilon == pytest.approx(distributed_figures([a_round(1)] * 2)[0] - first)


def test_a_ledger_of_the_format_before_distributed_dp_still_loads_and_keeps_its_jobs(tmp_path) -> None:
    path = tmp_path / "ledger.json"
    old = {"version": 1, "worker_id": "a", "jobs": {"job-old": {"epsilon": 1.5, "history": [[1.1, 0.02, 50]]}},
           "releases": {"label_histogram": {"epsilon": 0.5, "draw_epsilon": 0.5, "value": [3, 4],
                                            "source_sha256": "00"}}}
    path.write_text(json.dumps(old))
    ledger = PrivacyLedger(str(path), worker_id="a")
    assert ledger.jobs() == {"job-old": 1.5} and ledger.history("job-old") == [(1.1, 0.02, 50)]
    assert ledger.floors() == {} and ledger.distributed_rounds("job-old") == []
    ledger.record("job-old", history=[(1.1, 0.02, 60)], epsilon=1.75)
    assert json.loads(path.read_text())["version"] == 1     # no distributed round: still the old format
    ledger.record_distributed("job-d", step=a_round(), epsilon=0.5, floor_epsilon=2.0)
    doc = json.loads(path.read_text())
    assert doc["version"] == 2 and doc["jobs"]["job-old"] == {"epsilon": 1.75, "history": [[1.1, 0.02, 60]]}
    assert PrivacyLedger(str(path)).total_epsilon() == pytest.approx(1.75 + 0.5 + 0.5)


@pytest.mark.parametrize("broken", [
    {"floor_epsilon": 1.0},                                            # no rounds
    {"floor_epsilon": 1.0, "rounds": [{"round": 1}]},                  # a round missing its parameters
    {"floor_epsilon": 1.0, "rounds": [a_round().to_dict() | {"mu": -1.0}]},   # a negative share
    {"floor_epsilon": "x", "rounds": []},
])
def test_a_malformed_distributed_entry_is_refused_at_load(tmp_path, broken) -> None:
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"version": 2, "jobs": {"job-d": {"epsilon": 1.0, "history": [],
                                                                  "distributed": broken}}}))
    with pytest.raises(ConfigError, match="distributed-DP"):
        PrivacyLedger(str(path))


def test_the_ledger_command_shows_both_figures(tmp_path, capsys, monkeypatch) -> None:
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"), worker_id="site-a")
    ledger.record("job-1", history=[(1.1, 0.1, 10)], epsilon=1.25)
    distributed, floor = distributed_figures([a_round()])
    ledger.record_distributed("job-d", step=a_round(), epsilon=distributed, floor_epsilon=floor)
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump({"worker": {"id": "site-a", "ledger_path": "ledger.json",
                                                                     "dp": {"enabled": True}}}))
    monkeypatch.chdir(tmp_path)
    assert main(["ledger", "--config", "worker.yaml", "--json", "--no-remote"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["jobs"] == [{"job_id": "job-1", "epsilon": 1.25},
                            {"job_id": "job-d", "epsilon": distributed, "local_floor_epsilon": floor}]
    assert main(["ledger", "--config", "worker.yaml", "--no-remote"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("job-d"))
    assert f"{distributed:.4g}" in row and f"{floor:.4g}" in row and "ε local floor" in text
    assert math.isfinite(floor)
