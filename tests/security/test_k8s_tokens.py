"""deploy/k8s: the aggregation service and the coordinator load a token table from a mounted Secret, and every
identity that calls them carries, in its own Secret, a token that table maps to it with the right role."""

from __future__ import annotations

import os

import yaml

from fedbroker.config import load_config
from fedbroker.rpc.auth import TokenTable
from tests.ops.test_k8s import component, env_of, one, rendered


def _mounted_table(docs, name: str, tokens_file: str) -> TokenTable:
    pod = component(docs, name)[0]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    mount = mounts[os.path.dirname(tokens_file)]
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    secret = one(docs, "Secret", volume["secret"]["secretName"])
    assert volume["secret"]["defaultMode"] == 0o440
    return TokenTable.from_mapping(yaml.safe_load(secret["stringData"][os.path.basename(tokens_file)]))


def test_every_caller_of_the_aggregator_has_a_token_its_table_maps_to_it(tmp_path):
    docs = rendered("base")
    config_file = tmp_path / "config.yaml"
    config_file.write_text(one(docs, "ConfigMap", "fedbroker-config")["data"]["config.yaml"])
    shared = load_config(str(config_file), environ={})
    assert shared.aggregator.tokens_file and shared.coordinator.tokens_file  # authentication is on
    table = _mounted_table(docs, "aggregator", shared.aggregator.tokens_file)
    callers = [("coordinator", w) for w in component(docs, "coordinator")] + \
              [("worker", w) for w in component(docs, "worker")]
    assert len(callers) >= 3
    for role, workload in callers:
        config = load_config(str(config_file), environ=env_of(workload["spec"]["template"]["spec"]["containers"][0],
                                                              docs))
        identity = table.identify(config.client.token)
        assert identity is not None, workload["metadata"]["name"]
        assert identity.role == role
        assert identity.name == (config.worker.id if role == "worker" else "coordinator")
    submitters = _mounted_table(docs, "coordinator", shared.coordinator.tokens_file)
    assert len(submitters) >= 1
