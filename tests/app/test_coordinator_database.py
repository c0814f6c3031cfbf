"""`coordinator.database_url_file`: a coordinator process started from its config keeps its state in PostgreSQL
(the URL, with its password, read from a mounted secret file), its state directory only its checkpoints and the
mark saying where the state is; a job submitted to it is in the database, where a second store reads it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from fedbroker.app.launch import start_coordinator
from fedbroker.bus import InProcessBus
from fedbroker.config import load_config
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.coordinator.state_dir import DATABASE_MARK
from fedbroker.coordinator.store import DB_FILE, StateStore
from tests.postgres_node import scratch_database

JOB = {"name": "in-postgres", "category": "nobody",
       "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]},
       "schedule": {"wait_for_workers_s": 3600}}


def test_a_coordinator_configured_with_a_database_url_file_keeps_its_state_there(tmp_path: Path) -> None:
    with scratch_database() as url:
        secret = tmp_path / "database-url"
        secret.write_text(url.replace("postgres@", "postgres:not-checked-by-trust@", 1))
        secret.chmod(0o600)
        config_file = tmp_path / "coordinator.yaml"
        config_file.write_text(yaml.safe_dump({"coordinator": {
            "listen": "127.0.0.1:0", "state_dir": "state", "database_url_file": "database-url"}}))
        config = load_config(str(config_file), environ={})
        process = start_coordinator(config, bus=InProcessBus(namespace="database-url-test"))
        try:  # on a shared database it serves as a standby until it has taken the lease `coordinator`
            assert process.election is not None and process.election.leadership.leading.wait(60)
            client = CoordinatorClient(f"127.0.0.1:{process.port}", timeout_s=30)
            job_id = client.submit(json.dumps(JOB))
            client.close()
            assert process.coordinator.store.engine.dialect.name == "postgresql"
        finally:
            process.stop()
        state_dir = tmp_path / "state"
        assert (state_dir / DATABASE_MARK).is_file() and not (state_dir / DB_FILE).exists()
        again = StateStore.from_url(url)
        try:
            assert [j.job_id for j in again.jobs()] == [job_id]
        finally:
            again.close()
