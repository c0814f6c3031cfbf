"""Paths inside a `--config` file are read from the file's own folder, not from wherever the command runs (issue
"Hardening, fourth pass", defects): a viewer who ran `fedbroker jobs list --config kit/viewer.yaml` from a folder
holding another identity's `secrets/token` spoke to the coordinator as that identity. Against a real coordinator
process with token authentication."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedbroker.config import load_config
from fedbroker.rpc.auth import generate_token
from tests.integration.processes import Deployment, _clean_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_config_files_paths_resolve_from_its_folder_and_variables_from_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "viewer.yaml").write_text(yaml.safe_dump({"client": {"token_file": "secrets/token", "ca_file": "/abs/ca"},
                                                    "worker": {"ledger_path": "state/ledger.json"}}))
    monkeypatch.chdir(tmp_path)
    config = load_config(str(Path("kit") / "viewer.yaml"), environ={"FEDBROKER__CLIENT__KEY_FILE": "k.pem"})
    assert config.client.token_file == str(kit / "secrets" / "token")
    assert config.worker.ledger_path == str(kit / "state" / "ledger.json")
    assert (config.client.ca_file, config.client.key_file) == ("/abs/ca", "k.pem")


def test_a_worker_configs_image_folder_labels_and_masks_resolve_from_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """worker.data's labels CSV, masks folder and cache name files as `path` does: an example's worker.yaml
    (examples/xray-folders) reads the same site folder from wherever the worker starts."""
    site = tmp_path / "example"
    site.mkdir()
    (site / "worker.yaml").write_text(yaml.safe_dump({"worker": {"dataset": "images", "data": {
        "path": "data/images", "labels_csv": "data/findings.csv", "masks": "data/masks", "cache": "data/cache"}}}))
    monkeypatch.chdir(tmp_path)
    data = load_config(str(Path("example") / "worker.yaml"), environ={}).worker.data
    assert (data.path, data.labels_csv, data.masks, data.cache) == tuple(
        str(site / "data" / name) for name in ("images", "findings.csv", "masks", "cache"))
    off = load_config(str(site / "worker.yaml"), environ={"FEDBROKER__WORKER__DATA__CACHE": ""}).worker.data
    assert off.cache == ""  # the switch stays off: an empty setting is no path


def test_a_viewer_speaks_as_the_identity_its_config_names_from_any_folder(rabbitmq_url: str, tmp_path: Path) -> None:
    viewer, other = generate_token(), generate_token()
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump({"viewer": {"role": "viewer", "token": viewer}}))
    d = Deployment(rabbitmq_url, tmp_path, name="paths", worker_ids=[])
    try:
        d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator, "coordinator.tokens_file": tokens,
                                               "coordinator.state_dir": tmp_path / "state"})
        kit = tmp_path / "kit"
        (kit / "secrets").mkdir(parents=True)
        (kit / "secrets" / "token").write_text(viewer)
        (kit / "viewer.yaml").write_text(yaml.safe_dump({"client": {"token_file": "secrets/token"},
                                                        "coordinator": {"target": d.coordinator}}))
        here = tmp_path / "elsewhere"  # another identity's kit: its secrets/token is not the viewer's
        (here / "secrets").mkdir(parents=True)
        (here / "secrets" / "token").write_text(other)
        deadline = time.monotonic() + 120
        while True:
            done = subprocess.run([sys.executable, "-m", "fedbroker", "jobs", "list", "--config",
                                   str(Path("..") / "kit" / "viewer.yaml")], cwd=here, env=_clean_env(),
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0 or "unavailable" not in (done.stdout + done.stderr).lower() \
                    or time.monotonic() > deadline:
                break
            d.alive()
            time.sleep(0.5)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{d.logs()}"
    finally:
        d.close()
