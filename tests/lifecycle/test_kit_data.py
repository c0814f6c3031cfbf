"""A site listed in project.yaml without settings gets a kit whose worker.yaml says FILL-IN where the data goes,
and the worker refuses to start from it (naming the file and the keys) until they are filled in: it never
trains a federation's job on the default bundled set as if that were the site's data."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedbroker.app.provision import parse_project, provision
from fedbroker.app.unfilled import FILL_IN, refuse_unfilled, unfilled
from fedbroker.config import load_config
from fedbroker.errors import ConfigError
from tests.source_roots import PYTHONPATH

PROJECT = {
    "name": "study",
    "server": {"host": "localhost", "listen": "127.0.0.1"},
    "sites": [{"name": "bare"}, {"name": "dp-only", "worker": {"dp": {"epsilon_budget": 5}}},
              {"name": "named", "worker": {"dataset": "wine"}}],
}


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    out = tmp_path_factory.mktemp("kits") / "out"
    provision(parse_project(PROJECT), out)
    return out


def test_a_site_without_data_settings_gets_fill_in_markers_and_a_header_saying_so(kits):
    for site in ("bare", "dp-only"):
        text = (kits / "sites" / site / "worker.yaml").read_text()
        worker = yaml.safe_load(text)["worker"]
        assert worker["dataset"] == FILL_IN and worker["data"] == {"path": FILL_IN}
        assert "TO FILL IN before the first start" in text
        assert FILL_IN in (kits / "sites" / site / "README.md").read_text()
    assert yaml.safe_load((kits / "sites/dp-only/worker.yaml").read_text())["worker"]["dp"]["epsilon_budget"] == 5
    named = (kits / "sites/named/worker.yaml").read_text()
    assert FILL_IN not in named and yaml.safe_load(named)["worker"]["dataset"] == "wine"


def start_worker(kit: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The kit's worker as start.sh runs it (in the kit, `fedbroker worker --config worker.yaml`); no broker
    answers (every broker setting points nowhere), so a worker that got past its checks would keep retrying:
    the timeout is only a hang guard."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    return subprocess.run([sys.executable, "-m", "fedbroker", "worker", "--config", "worker.yaml"], cwd=kit,
                          env={**clean, "PYTHONPATH": PYTHONPATH, **env}, capture_output=True, text=True, timeout=120)


def test_the_worker_refuses_an_unfilled_kit_naming_the_file_and_the_keys(kits):
    done = start_worker(kits / "sites/bare")
    assert done.returncode == 2, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("fedbroker worker:")]
    assert line.startswith("fedbroker worker: config: worker.yaml: the site's data is not filled in yet: "
                           "worker.dataset, worker.data.path still say FILL-IN; set worker.dataset to csv")
    assert "Traceback" not in done.stderr
    assert not (kits / "sites/bare/state/ledger.json").exists()  # refused before the worker opened anything


def test_fill_in_left_in_any_setting_is_refused_and_filled_ones_pass(tmp_path):
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump({"worker": {"dataset": "csv", "data": {"path": FILL_IN, "label_column": "y"}}}))
    config = load_config(str(path), environ={})
    assert unfilled(config.worker) == ["worker.data.path"]
    with pytest.raises(ConfigError, match=r"^.*worker\.yaml: .*worker\.data\.path still say FILL-IN"):
        refuse_unfilled(config.worker, str(path))
    # the environment fills it as it fills any setting
    filled = load_config(str(path), environ={"FEDBROKER__WORKER__DATA__PATH": "/data/mine.csv"})
    refuse_unfilled(filled.worker, str(path))
    path.write_text(yaml.safe_dump({"worker": {"dataset": "idx", "idx_dir": "/data", "data": {"classes": [FILL_IN]}}}))
    assert unfilled(load_config(str(path), environ={}).worker) == ["worker.data.classes"]
