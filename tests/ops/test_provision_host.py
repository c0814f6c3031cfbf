"""A provisioned server kit runs on a host as it does on Kubernetes: its rabbitmq.conf names the kit's own files
(relative to the kit, no Kubernetes mount points) and binds where the project says, its services serve metrics
on the host only, and a Prometheus config beside the kit scrapes them (promtool accepts it). Its broker is a
node of its own beside the host's RabbitMQ, and the `broker sync` lines reach that node only. The Kubernetes
rendering keeps its mounts, and after the kit has been changed in place it still renders, the CRL among its
TLS Secret's files."""

from __future__ import annotations

import base64
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pika
import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.app.provision import lifecycle, parse_project, provision
from fedbroker.config import load_config
from tests.ops.conftest import tool
from tests.ops.test_k8s import K8S_VERSION, validator
from tests.rabbitmq_node import KitBroker, amqps, free_ports, machine_broker_state, missing, server_scripts
from tests.source_roots import PYTHONPATH

PROJECT = {
    "name": "study",
    "server": {"host": "fl.example.org"},
    "sites": [{"name": "hospital-a", "worker": {"dataset": "digits"}}],
    "scientists": [{"name": "alice"}],
}


def kits_of(tmp_path: Path, **server: object) -> Path:
    out = tmp_path / "kits"
    provision(parse_project({**PROJECT, "server": {**PROJECT["server"], **server}}), out)
    return out


def conf(kit: Path, name: str = "rabbitmq/rabbitmq.conf") -> dict[str, str]:
    lines = [line for line in (kit / name).read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split(" = ", 1) for line in lines)


def test_the_host_rabbitmq_conf_names_the_kits_files_and_binds_management_to_this_host(tmp_path):
    server = kits_of(tmp_path) / "server"
    text = (server / "rabbitmq/rabbitmq.conf").read_text()
    assert "/etc/" not in text
    settings = conf(server)
    assert not settings["load_definitions"].startswith("/") and (server / settings["load_definitions"]).is_file()
    assert settings["listeners.ssl.default"] == "5671" and settings["listeners.tcp"] == "none"   # the sites reach it
    assert settings["management.tcp.ip"] == settings["prometheus.tcp.ip"] == "127.0.0.1"
    assert not [key for key in settings if key.startswith("ssl_options")]   # advanced.config's would replace them
    ssl_options = (server / "rabbitmq/advanced.config").read_text()
    files = dict(re.findall(r"\{(cacertfile|certfile|keyfile|dir), \"([^\"]+)\"\}", ssl_options))
    assert files == {"cacertfile": "ca.crt", "certfile": "tls/broker.crt", "keyfile": "tls/broker.key",
                     "dir": "rabbitmq/crls"}
    for name in files.values():
        assert (server / name).exists(), name
    for option in ("{verify, verify_peer}", "{fail_if_no_peer_cert, true}", "{crl_check, peer}"):
        assert option in ssl_options
    # the broker refuses every client certificate without a CRL of the CA: the kit has the (empty) one there
    (crl,) = (server / "rabbitmq/crls").iterdir()
    assert crl.name.endswith(".r0") and crl.read_bytes() == (server / "crl.pem").read_bytes()
    assert (server / "rabbitmq/enabled_plugins").read_text() == "[rabbitmq_management,rabbitmq_prometheus].\n"
    # Kubernetes keeps its own, with the Secrets' mount points
    assert '{cacertfile, "/etc/rabbitmq-tls/ca.crt"}' in (server / "k8s/advanced.config").read_text()


def test_the_host_configs_bind_where_the_project_asks(tmp_path):
    server = kits_of(tmp_path, listen="192.0.2.10", broker_port=5800, metrics_addr="10.1.2.3",
                     aggregator_metrics_port=9501, coordinator_metrics_port=0) / "server"
    settings = conf(server)
    assert settings["listeners.ssl.default"] == "192.0.2.10:5800"
    assert settings["management.tcp.ip"] == settings["prometheus.tcp.ip"] == "10.1.2.3"
    aggregator = load_config(str(server / "aggregator.yaml"), environ={}).aggregator
    assert (aggregator.listen, aggregator.metrics_addr, aggregator.metrics_port) == ("192.0.2.10:50051", "10.1.2.3",
                                                                                     9501)
    coordinator = load_config(str(server / "coordinator.yaml"), environ={}).coordinator
    assert coordinator.metrics_port == 0   # 0: the project turned it off
    scrape = yaml.safe_load((server / "prometheus/prometheus.yml").read_text())
    assert {c["job_name"]: c["static_configs"][0]["targets"] for c in scrape["scrape_configs"]} == {
        "fedbroker-aggregator": ["10.1.2.3:9501"], "rabbitmq": ["10.1.2.3:15692"]}


def test_metrics_are_on_by_default_on_this_host_only(tmp_path):
    kits = kits_of(tmp_path)
    aggregator = load_config(str(kits / "server/aggregator.yaml"), environ={}).aggregator
    coordinator = load_config(str(kits / "server/coordinator.yaml"), environ={}).coordinator
    assert (aggregator.metrics_addr, aggregator.metrics_port) == ("127.0.0.1", 9401)
    assert (coordinator.metrics_addr, coordinator.metrics_port) == ("127.0.0.1", 9402)
    scrape = yaml.safe_load((kits / "server/prometheus/prometheus.yml").read_text())
    assert {c["job_name"]: c["static_configs"][0]["targets"] for c in scrape["scrape_configs"]} == {
        "fedbroker-aggregator": ["127.0.0.1:9401"], "fedbroker-coordinator": ["127.0.0.1:9402"],
        "rabbitmq": ["127.0.0.1:15692"]}
    site = yaml.safe_load((kits / "sites/hospital-a/prometheus/prometheus.yml").read_text())
    (job,) = site["scrape_configs"]
    assert job["job_name"] == "fedbroker-worker" and job["static_configs"][0]["targets"] == ["127.0.0.1:9400"]
    assert job["static_configs"][0]["labels"] == {"project": "study", "site": "hospital-a"}


@pytest.mark.parametrize("kit", ["server", "sites/hospital-a"])
def test_promtool_accepts_the_kits_scrape_config(tmp_path, kit):
    folder = kits_of(tmp_path) / kit / "prometheus"
    result = subprocess.run([tool("promtool"), "check", "config", "prometheus.yml"], cwd=folder, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_overlay_still_renders_after_add_and_revoke_with_the_crl_in_its_tls_secret(tmp_path):
    kits = kits_of(tmp_path)
    lifecycle.add(kits, site={"name": "hospital-c"})
    lifecycle.revoke(kits, name="hospital-a")
    result = subprocess.run([tool("kubectl"), "kustomize", str(kits / "server")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "fedbroker-server-tls")
    assert "crl.pem" in secret["data"]
    config = yaml.safe_load(next(d for d in docs if d["metadata"]["name"] == "fedbroker-config")["data"]["config.yaml"])
    assert config["coordinator"]["worker_broker_users"] == {"study-hospital-c": ["hospital-c"]}
    rabbit = next(d for d in docs if d["metadata"]["name"] == "rabbitmq-config")["data"]
    assert not re.search(r"^ssl_options", rabbit["rabbitmq.conf"], re.M)
    assert '{cacertfile, "/etc/rabbitmq-tls/ca.crt"}' in rabbit["advanced.config"]
    assert '{crl_cache, {ssl_crl_hash_dir, {internal, [{dir, "/etc/rabbitmq-tls"}]}}}' in rabbit["advanced.config"]
    # the broker's CRL folder is the TLS Secret's mount: the CRL is there under the name the cache looks for
    (hashed,) = [key for key in secret["data"] if key.endswith(".r0")]
    assert secret["data"][hashed] == secret["data"]["crl.pem"]
    assert base64.b64decode(secret["data"]["crl.pem"]) == (kits / "server/crl.pem").read_bytes()
    # the gRPC services read crl.pem beside their client CA: the whole Secret mounted there (no subPath, so a
    # `kubectl apply -k` after a revocation reaches the running pods)
    for role in ("aggregator", "coordinator"):
        assert config[role]["tls"]["client_ca_file"] == "/etc/fedbroker-tls/ca.crt"
        (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"fedbroker-{role}"]
        pod = deployment["spec"]["template"]["spec"]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/etc/fedbroker-tls"]
        assert "subPath" not in mount
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "fedbroker-server-tls"
    (broker,) = [d for d in docs if d["kind"] == "StatefulSet"]
    mounts = {m["mountPath"]: m for m in broker["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/etc/rabbitmq/advanced.config"]["subPath"] == "advanced.config"
    assert mounts["/etc/rabbitmq-tls"]["name"] == "tls"
    kv = validator()
    for doc in docs:   # the changed kit still renders objects the cluster accepts
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


# ----- the kit's own broker, started by its start-broker.sh on this host -----


class HostKit(NamedTuple):
    kits: Path
    node: KitBroker
    management: int
    metrics: int


@pytest.fixture(scope="module")
def host_kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostKit]:
    """A kit provisioned for this host, its broker started by the kit's start-broker.sh (with this session's own
    epmd and cookie, never the machine's broker's), every port of it where the project puts it."""
    scripts = server_scripts()
    broker_port, management, metrics, dist = free_ports(4)
    kits = kits_of(tmp_path_factory.mktemp("host"), host="localhost", listen="127.0.0.1", broker_port=broker_port,
                   broker_management_port=management, broker_metrics_port=metrics, broker_dist_port=dist)
    node = KitBroker(kits / "server", scripts, kits / "sites/hospital-a")
    try:
        node.start()
        yield HostKit(kits, node, management, metrics)
    finally:
        node.stop()


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_rabbitmq_runs_from_the_host_kit_with_mutual_tls_and_host_only_management(host_kit):
    """The kit's rabbitmq.conf as written (its paths relative to the kit), its two host-only ports where the
    project puts them (server.broker_management_port, broker_metrics_port: this machine's 15672 may be taken; they
    were hard-coded): a site logs in over AMQPS with its kit; without its client certificate it is refused;
    management and /metrics answer on 127.0.0.1, and the kit's Prometheus config scrapes that port."""
    kits, metrics = host_kit.kits, host_kit.metrics
    scrape = yaml.safe_load((kits / "server/prometheus/prometheus.yml").read_text())
    assert {c["job_name"]: c["static_configs"][0]["targets"] for c in scrape["scrape_configs"]}["rabbitmq"] == [
        f"127.0.0.1:{metrics}"]
    connection = amqps(kits / "sites/hospital-a", certificate=True)
    assert connection.is_open
    connection.close()
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        amqps(kits / "sites/hospital-a", certificate=False)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=30) as page:
        assert "rabbitmq_" in page.read().decode()
    with pytest.raises(urllib.error.HTTPError) as unauthorized:  # it listens, and asks who is calling
        urllib.request.urlopen(f"http://127.0.0.1:{host_kit.management}/api/overview", timeout=30)
    assert unauthorized.value.code == 401


def _run_printed(printed: str, node: KitBroker) -> str:
    """The `fedbroker broker sync` line `provision` printed for the broker's host, run exactly as printed there
    (RabbitMQ's rabbitmqctl on PATH, the broker's cookie and epmd), after checking it names the kit's node."""
    (line,) = [x.strip() for x in printed.splitlines() if x.strip().startswith("fedbroker broker sync")
               and "--rabbitmqctl" not in x]
    assert f"--node {node.name}" in line, f"the host's sync line does not name the kit's node: {line}"
    done = subprocess.run([sys.executable, "-m", "fedbroker", *shlex.split(line)[1:]], capture_output=True,
                          text=True, timeout=300, env={**node.env, "PYTHONPATH": PYTHONPATH})
    assert done.returncode == 0, f"{line}: {done.stdout}\n{done.stderr}"
    return done.stdout


def _logs_in(kit: Path) -> bool:
    try:
        amqps(kit).close()
        return True
    except pika.exceptions.AMQPConnectionError:
        return False


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_the_printed_sync_line_changes_the_kits_own_broker_and_never_the_machines(host_kit, capsys):
    """The host kit's broker is a node of its own (start-broker.sh sets RABBITMQ_NODENAME), and the `broker sync`
    line `provision add`/`revoke` print names it (--node): run as printed on the broker's host, it adds the new
    site's user to the kit's broker and then deletes it, and the machine's own RabbitMQ (the default node a
    line without a node reaches) keeps exactly its users. Before, the line named no node."""
    kits, node = host_kit.kits, host_kit.node
    script = (kits / "server/start-broker.sh").read_text()
    assert f"RABBITMQ_NODENAME='{node.name}'" in script and node.name == "fedbroker-study@localhost"
    try:
        machine_before = machine_broker_state()
    except RuntimeError as exc:   # read-only; the comparison below needs it
        missing(f"cannot read the machine's broker with rabbitmqctl: {exc}")
    assert main(["provision", "add", "--out", str(kits), "--site", "hospital-c"]) == 0
    synced = _run_printed(capsys.readouterr().out, node)
    assert "add study-hospital-c" in synced, synced
    assert _logs_in(kits / "sites/hospital-c") and "study-hospital-c" in node.ctl("list_users", "-q")
    assert main(["provision", "revoke", "--out", str(kits), "--name", "hospital-c"]) == 0
    synced = _run_printed(capsys.readouterr().out, node)
    assert "delete and disconnect study-hospital-c" in synced and "installed" in synced, synced
    assert "study-hospital-c" not in node.ctl("list_users", "-q") and not _logs_in(kits / "sites/hospital-c")
    assert _logs_in(kits / "sites/hospital-a")   # the others' logins are the kit's still
    assert machine_broker_state() == machine_before
