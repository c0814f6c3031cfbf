"""`fedbroker provision`: what each kit holds (and does not), the server overlay renders and validates, and a
federation started from the kits alone runs a round over TLS on loopback."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

import grpc
import pika
import pytest
import yaml
from cryptography import x509

from fedbroker.app.cli import main
from fedbroker.app.provision import Project, Site, k8s, parse_project, provision
from fedbroker.errors import ConfigError
from tests.integration.processes import stop_all
from tests.ops.conftest import tool
from tests.security.tlsproxy import TlsProxy
from tests.source_roots import PYTHONPATH, SOURCE_ROOTS

ROOT = Path(__file__).resolve().parents[2]
PROJECT = {
    "name": "study",
    "server": {"host": "fl.example.org", "sans": ["203.0.113.7"]},
    "sites": [{"name": "hospital-a", "worker": {"dataset": "digits", "dp": {"enabled": False}}},
              {"name": "hospital-b", "categories": ["digits", "scans"]}],
    "scientists": [{"name": "alice"}, {"name": "carol", "role": "viewer"}],
}

SECRETS = {"rabbitmq/definitions.json", "k8s/coordinator.env"}  # password hashes; the coordinator's broker URL


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    out = tmp_path_factory.mktemp("kits") / "out"
    provision(parse_project(PROJECT), out)
    return out


def files(folder: Path) -> dict[str, Path]:
    return {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file()}


def is_private_key(path: Path) -> bool:
    return b"PRIVATE KEY" in path.read_bytes()


def test_each_kit_holds_only_its_own_private_keys_owner_only(kits):
    keys = sorted(str(p.relative_to(kits)) for p in kits.rglob("*") if p.is_file() and is_private_key(p))
    assert keys == ["ca/ca.key", "scientists/alice/tls/client.key", "scientists/carol/tls/client.key",
                    "server/tls/aggregator.key", "server/tls/broker.key", "server/tls/coordinator-client.key",
                    "server/tls/coordinator.key", "sites/hospital-a/tls/client.key", "sites/hospital-b/tls/client.key"]
    for kit in [kits / "server", *(kits / "sites").iterdir(), *(kits / "scientists").iterdir()]:
        assert stat.S_IMODE(kit.stat().st_mode) == 0o700, kit
        for name, path in files(kit).items():
            if name.startswith(("secrets/", "tokens/")) or name.endswith(".key") or name in SECRETS:
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            assert "ca.key" not in name
    assert stat.S_IMODE((kits / "ca/ca.key").stat().st_mode) == 0o600


def test_each_kit_holds_its_own_token_and_the_server_holds_only_their_digests(kits):
    from fedbroker.rpc.auth import TokenTable

    table = TokenTable.from_file(str(kits / "server/tokens/aggregator.yaml"))
    for site in ("hospital-a", "hospital-b"):
        token = (kits / "sites" / site / "secrets/token").read_text().strip()
        assert table.identify(token).name == site and table.identify(token).role == "worker"
        assert token not in (kits / "server/tokens/aggregator.yaml").read_text()
    coordinator_table = TokenTable.from_file(str(kits / "server/tokens/coordinator.yaml"))
    assert coordinator_table.identify((kits / "scientists/carol/secrets/token").read_text().strip()).role == "viewer"
    alice = (kits / "scientists/alice/secrets/token").read_text().strip()
    assert coordinator_table.identify(alice).role == "submitter"
    assert table.identify(alice) is None  # a scientist's token opens nothing on the aggregation service
    for site in ("hospital-a", "hospital-b"):  # a site's token reads its own record there (SiteRecord), no more
        identity = coordinator_table.identify((kits / "sites" / site / "secrets/token").read_text().strip())
        assert identity.name == site and identity.role == "worker"
    worker = yaml.safe_load((kits / "sites/hospital-b/worker.yaml").read_text())
    assert worker["worker"]["id"] == "hospital-b" and worker["worker"]["categories"] == ["digits", "scans"]
    assert worker["aggregator"]["target"] == "fl.example.org:50051"
    assert worker["coordinator"] == {"target": "fl.example.org:50052"}  # what `fedbroker ledger --kit` asks
    # metrics on, for the site's own host only
    assert (worker["worker"]["metrics_port"], worker["worker"]["metrics_addr"]) == (9400, "127.0.0.1")
    assert (kits / "sites/hospital-a/secrets/broker-url").read_text().startswith(
        "amqps://study-hospital-a:")


def test_server_certificates_name_the_public_host_and_the_in_cluster_services(kits):
    ca = x509.load_pem_x509_certificate((kits / "ca/ca.crt").read_bytes())
    for role, service in (("coordinator", "fedbroker-coordinator"), ("aggregator", "fedbroker-aggregator"),
                          ("broker", "rabbitmq")):
        cert = x509.load_pem_x509_certificate((kits / f"server/tls/{role}.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "fl.example.org" in san.get_values_for_type(x509.DNSName)
        assert f"{service}.fedbroker.svc" in san.get_values_for_type(x509.DNSName)
        assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["203.0.113.7"]
    assert (kits / "sites/hospital-a/ca.crt").read_bytes() == (kits / "ca/ca.crt").read_bytes()
    for folder, identity in (("sites/hospital-a", "hospital-a"), ("scientists/alice", "alice"),
                             ("server", "coordinator")):
        name = "tls/coordinator-client.crt" if folder == "server" else "tls/client.crt"
        cert = x509.load_pem_x509_certificate((kits / folder / name).read_bytes())
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == identity
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usage) == [x509.ExtendedKeyUsageOID.CLIENT_AUTH]  # it cannot pose as a server


def test_the_server_overlay_renders_validates_and_exposes_amqps_and_grpc_over_tls(kits):
    result = subprocess.run([tool("kubectl"), "kustomize", str(kits / "server")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    try:
        import kubernetes_validate as kv
    except ImportError:
        from tests.ops.conftest import missing

        missing("kubernetes-validate is not installed: pip install -r requirements.txt")
    for doc in docs:
        kv.validate(doc, "1.37.0", strict=True)
    public = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service" and d["spec"].get("type") == "LoadBalancer"}
    assert {n: [p["port"] for p in d["spec"]["ports"]] for n, d in public.items()} == {
        "fedbroker-public-broker": [5671], "fedbroker-public-aggregator": [50051], "fedbroker-public-coordinator": [50052]}
    assert not [d for d in docs if d["kind"] == "Deployment" and "worker" in d["metadata"]["name"]]
    # deploy/OPERATING.md's `kubectl get svc -l app.kubernetes.io/part-of=fedbroker` lists the balancers too
    part_of = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"
               and d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "fedbroker"}
    assert set(public) <= part_of
    assert all(d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "fedbroker" for d in docs
               if d["kind"] != "Namespace"), [d["metadata"]["name"] for d in docs
                                              if "app.kubernetes.io/part-of" not in d["metadata"].get("labels", {})]
    config = yaml.safe_load(next(d for d in docs if d["metadata"]["name"] == "fedbroker-config")["data"]["config.yaml"])
    assert config["aggregator"]["tls"]["cert_file"] == "/etc/fedbroker-tls/aggregator.crt"
    assert config["coordinator"]["tls"]["key_file"] == "/etc/fedbroker-tls/coordinator.key"
    rabbit = next(d for d in docs if d["metadata"]["name"] == "rabbitmq-config")["data"]["rabbitmq.conf"]
    assert "listeners.tcp = none" in rabbit and "listeners.ssl.default = 5671" in rabbit
    for d in docs:
        if d["kind"] == "Deployment":  # kubelet's gRPC probes speak no TLS: TCP probes on TLS ports
            container = d["spec"]["template"]["spec"]["containers"][0]
            assert "grpc" not in container["readinessProbe"] and "tcpSocket" in container["readinessProbe"]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "fedbroker-coordinator")
    assert set(secret["data"]) == {"FEDBROKER__BROKER__URL", "FEDBROKER__CLIENT__TOKEN"}
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert {"public-broker-ingress", "public-aggregator-ingress", "public-coordinator-ingress"} <= set(policies)
    # inside the cluster too, the broker is reached on AMQPS only, and the coordinator may reach the
    # aggregation service's public address (its tasks name it)
    assert policies["rabbitmq-ingress"]["spec"]["ingress"][0]["ports"][0]["port"] == 5671
    assert policies["broker-and-aggregator-egress"]["spec"]["egress"][0]["ports"][0]["port"] == 5671
    egress = policies["coordinator-public-aggregator-egress"]["spec"]["egress"][0]
    assert egress["ports"] == [{"protocol": "TCP", "port": 50051}]


@pytest.mark.parametrize("change, field", [
    ({"server": {"host": "not a host!"}}, "server.host"),
    ({"sites": []}, "sites"),
    ({"sites": [{"name": "a/b"}]}, "sites[0].name"),
    ({"sites": [{"name": "a", "worker": {"id": "b"}}]}, "sites[0].worker.id"),
    ({"scientists": [{"name": "x", "role": "coordinator"}]}, "scientists[0].role"),
    ({"scientists": [{"name": "hospital-a"}]}, "sites/scientists"),
    ({"server": {"host": "h", "broker_port": 70000}}, "server.broker_port"),
    ({"server": {"host": "h", "broker_dist_port": 0}}, "server.broker_dist_port"),
    ({"sites": [{"name": "a", "worker": {"dp": {"epsilon_budget": -1}}}]}, "sites[0].worker.dp.epsilon_budget"),
    ({"sites": [{"name": "a"}, {"name": "b", "worker": {"datset": "digits"}}]}, "sites[1].worker.datset"),
])
def test_a_bad_project_is_refused_naming_the_field_and_nothing_is_written(tmp_path, change, field):
    with pytest.raises(ConfigError) as refused:
        provision(parse_project({**PROJECT, **change}), tmp_path / "out")
    assert field in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_a_site_setting_that_does_not_load_is_refused_at_provision_time(tmp_path):
    project = {**PROJECT, "sites": [{"name": "a", "worker": {"datset": "digits"}}]}
    with pytest.raises(ConfigError, match=r"worker\.datset: unknown setting"):
        provision(parse_project(project), tmp_path / "out")


def test_every_bad_site_setting_is_named_with_its_site_at_once(tmp_path):
    project = {**PROJECT, "sites": [{"name": "a", "worker": {"dp": {"epsilon_budget": -1}}},
                                    {"name": "b", "worker": {"datset": "digits"}}]}
    with pytest.raises(ConfigError) as refused:
        parse_project(project)
    message = str(refused.value)
    assert "sites[0].worker.dp.epsilon_budget: must be > 0" in message and "(site 'a')" in message
    assert "sites[1].worker.datset: unknown setting" in message and "(site 'b')" in message


@pytest.mark.parametrize("existing", [False, True])
def test_provision_checks_every_kit_config_before_it_writes_anything(tmp_path, existing):
    """Even a Project built without parse_project: provision loads each config its kits will hold before it
    creates the CA (an empty --out folder stays empty)."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    project = Project(name="study", host="fl.example.org",
                      sites=(Site("a", ("digits",), {"dataset": "digits"}),
                             Site("b", ("digits",), {"dp": {"epsilon_budget": -1}})))
    with pytest.raises(ConfigError, match=r"sites\[1\]\.worker\.dp\.epsilon_budget: .*site 'b'"):
        provision(project, out)
    assert (list(out.iterdir()) == []) if existing else not out.exists()


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_while_writing_leaves_no_half_written_kit(tmp_path, monkeypatch, existing):
    """A CA key and tokens from a failed run must not stay behind (a rerun would refuse the non-empty folder)."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(k8s, "overlay", broken)
    with pytest.raises(OSError, match="disk full"):
        provision(parse_project(PROJECT), out)
    assert (list(out.iterdir()) == []) if existing else not out.exists()


def test_a_missing_kubernetes_base_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(k8s, "BASE", tmp_path / "no-base")
    with pytest.raises(ConfigError, match="Kubernetes base"):
        provision(parse_project(PROJECT), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_kits_are_never_written_over(tmp_path, kits):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        provision(parse_project(PROJECT), tmp_path / "out")


# ----- a federation from its kits, over TLS on loopback -----


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# One round of a small model; its waits are far beyond the test's timeout, so the round ends on its upload.
TLS_JOB = {
    "name": "tls", "category": "digits", "seed": 0,
    "model": {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                   {"type": "Linear", "in_features": 64, "out_features": 10}]},
    "training": {"rounds": 1, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
    "schedule": {"min_workers": 1, "wait_for_workers_s": 1200, "round_timeout_s": 1200},
}


def start(script: Path, logs: Path) -> subprocess.Popen:
    """A kit's start script as its participant runs it: the kit's own files only, no FEDBROKER__ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update(FEDBROKER=f"{sys.executable} -m fedbroker", PYTHONPATH=PYTHONPATH)  # as if `pip install`ed
    log = open(logs / f"{script.parent.name}-{script.stem}.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([str(script)], cwd=logs, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_round_runs_over_tls_from_the_kits_alone(private_rabbitmq, tmp_path, monkeypatch, capsys):
    """The aggregation service, the coordinator and one worker start from their kits' scripts, the scientist
    submits with its kit's config; gRPC is mutual TLS end to end (plaintext, or TLS without a client
    certificate, is refused), and the broker leg is AMQPS with the kit's users, CA and client certificates.
    The kit's users go into the session's private RabbitMQ node, never the machine's (a test adds no user
    there). That node listens on plain AMQP only, so a TLS terminator holding the kit's broker certificate
    stands where the kit's RabbitMQ would listen on 5671 (it does not demand the client certificates the
    kit's rabbitmq.conf does: that leg of mutual TLS is not exercised here)."""
    broker = private_rabbitmq
    name = f"loop{uuid.uuid4().hex[:6]}"
    ports = {"coordinator_port": free_port(), "aggregator_port": free_port(), "broker_port": free_port(),
             "metrics_port": free_port()}
    server = {k: v for k, v in ports.items() if k != "metrics_port"}
    project = parse_project({
        "name": name,
        "server": {"host": "localhost", "listen": "127.0.0.1", "namespace": f"fedbroker-{name}", **server,
                   "aggregator_metrics_port": free_port(), "coordinator_metrics_port": free_port()},
        "sites": [{"name": "site0", "worker": {"dataset": "digits", "dp": {"enabled": False}, "heartbeat_s": 1,
                                                 "device": "cpu", "torch_threads": 1,
                                                 "metrics_port": ports["metrics_port"]}}],
        "scientists": [{"name": "sci"}],
    })
    out = tmp_path / "kits"
    provision(project, out)
    definitions = out / "server/rabbitmq/definitions.json"
    # the kit's own definitions (users with RabbitMQ password hashes), as the server's broker loads them; the
    # private node runs as this user, so it reads the kit's owner-only file as it is
    users = [u["name"] for u in json.loads(definitions.read_text())["users"]]
    broker.ctl("import_definitions", str(definitions))
    proxy = TlsProxy(out / "server/tls/broker.crt", out / "server/tls/broker.key",
                     upstream=("127.0.0.1", broker.amqp_port), port=ports["broker_port"])
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: list[subprocess.Popen] = []
    try:
        processes.append(start(out / "server/start-aggregator.sh", logs))
        processes.append(start(out / "server/start-coordinator.sh", logs))
        processes.append(start(out / "sites/site0/start.sh", logs))
        monkeypatch.chdir(out / "scientists/sci")
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(TLS_JOB))
        deadline = time.monotonic() + 240
        while main(["jobs", "list", "--config", "fedbroker.yaml"]) != 0:  # the coordinator is still starting
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), _logs(logs)
            time.sleep(1)
        capsys.readouterr()
        assert main(["submit", str(job), "--config", "fedbroker.yaml"]) == 0
        job_id = capsys.readouterr().out.strip()
        status = ""
        while status not in ("completed", "failed"):
            assert time.monotonic() < deadline + 120 and all(p.poll() is None for p in processes), _logs(logs)
            time.sleep(1)
            assert main(["jobs", "show", job_id, "--json", "--config", "fedbroker.yaml"]) == 0
            shown = json.loads(capsys.readouterr().out)
            status = shown["status"]
        assert status == "completed", (shown, _logs(logs))
        assert [(r["round"], r["status"], r["aggregated"]) for r in shown["rounds"]] == [(1, "closed", 1)]
        assert proxy.connections >= 2  # the coordinator and the worker came in over AMQPS
        _assert_the_site_sees_its_ledger_and_record(out / "sites/site0", job_id, ports["metrics_port"], capsys)

        _assert_grpc_is_mutual_tls_only((out / "sites/site0/ca.crt").read_bytes(),
                                        (ports["coordinator_port"], ports["aggregator_port"]))
        url = urlsplit((out / "sites/site0/secrets/broker-url").read_text().strip())
        assert url.scheme == "amqps" and url.username == f"{name}-site0"
        # the site's broker user reads its own task queue only: another site's is refused
        _declare(broker.url, f"fedbroker-{name}.worker.ghost")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="ACCESS_REFUSED"):
            _basic_get((out / "sites/site0/secrets/broker-url").read_text().strip(), out / "sites/site0",
                       f"fedbroker-{name}.worker.ghost")
    finally:
        stop_all(list(reversed(processes)))
        proxy.close()
        from fedbroker.bus import delete_topology

        delete_topology(broker.url, f"fedbroker-{name}", ["site0", "ghost"])
        for user in users:  # the session's later tests share the node
            broker.ctl("delete_user", user)


def _assert_the_site_sees_its_ledger_and_record(kit: Path, job_id: str, metrics_port: int, capsys) -> None:
    """`fedbroker ledger --kit` asks the coordinator over mutual TLS with the kit's own certificate and token (the
    kit names the coordinator): its record holds the job; the worker's metrics are served on the site's host."""
    assert main(["ledger", "--kit", str(kit), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    remote = view["coordinator"]
    assert remote["error"] == "" and remote["worker"]["worker_id"] == "site0"
    assert [(j["job_id"], j["status"], j["rounds"]) for j in remote["jobs"]] == [(job_id, "completed", 1)]
    assert view["agreement"]["status"] == "agree", view["agreement"]
    uploaded = 'fedbroker_worker_tasks_total{outcome="uploaded",worker_id="site0"} 1.0'
    deadline = time.monotonic() + 60  # the worker counts its upload as it finishes the task: just after the close
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as page:
            if uploaded in page.read().decode():
                break
        assert time.monotonic() < deadline, "the site's worker never counted its upload on /metrics"
        time.sleep(0.2)


def _assert_grpc_is_mutual_tls_only(ca: bytes, ports: tuple[int, ...]) -> None:
    """A plaintext connection to each port fails, and so does TLS with the project CA but no client certificate."""
    for port in ports:
        for channel in (grpc.insecure_channel(f"127.0.0.1:{port}"),
                        grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(ca))):
            with pytest.raises(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=3)
            channel.close()


def _logs(folder: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(folder.glob("*.log")))


def _declare(url: str, queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    connection.channel().queue_declare(queue, durable=True)
    connection.close()


def _basic_get(url: str, kit: Path, queue: str) -> None:
    params = pika.URLParameters(url)
    context = ssl.create_default_context(cafile=str(kit / "ca.crt"))
    context.load_cert_chain(str(kit / "tls/client.crt"), str(kit / "tls/client.key"))
    params.ssl_options = pika.SSLOptions(context, "localhost")
    connection = pika.BlockingConnection(params)
    try:
        connection.channel().basic_get(queue)
    finally:
        if connection.is_open:
            connection.close()


def test_a_site_kit_says_how_to_install_fedbroker_from_its_source(kits):
    readme = (kits / "sites/hospital-a/README.md").read_text()
    assert "pip install fedbroker" not in readme  # not published: it would fail, or install someone else's
    assert "pip install torch==2.13.0" in readme and "`pip install .`" in readme
    scientist = (kits / "scientists/alice/README.md").read_text()
    assert "`pip install .`" in scientist
    for setting in ("TOKEN_FILE", "CA_FILE", "CERT_FILE", "KEY_FILE"):  # what --coordinator host:port needs
        assert f"FEDBROKER__CLIENT__{setting}" in scientist


# ----- installed, not a checkout; the server's launcher -----

PACKAGE_SOURCES = ("pyproject.toml", "README.md", "MANIFEST.in", "requirements.txt", "requirements-dev.txt",
                   "requirements-tracking.txt", "app",
                   "fedbroker", "aggregators", "coordinator", "worker", "proto", "deploy/k8s/base", "examples/models")


def _no_fedbroker_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__") and k != "PYTHONPATH"}


class Installed(NamedTuple):
    """A wheel built from a copy of the sources and installed with --target, away from the checkout."""

    site: Path       # the --target folder: the package, its metadata and bin/fedbroker
    cwd: Path        # where its commands run: no checkout here
    env: dict[str, str]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """`pip install .` (and the image) hold no deploy/ and no checkout: what the wheel lacks, its commands lack."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    for name in PACKAGE_SOURCES:  # a copy, so the build writes no build/ or egg-info into the checkout
        source, target = ROOT / name, src / name
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
                            str(src)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "dist").glob("fedbroker-*.whl"))
    site = tmp_path / "site"
    done = subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # every module of the tree is in the wheel: a module left out could still import from an editable
    # install of the checkout in this venv, and the commands below would not notice
    in_tree = {str(p.relative_to(root)) for root in SOURCE_ROOTS for p in (root / "fedbroker").rglob("*.py")}
    assert in_tree == {str(p.relative_to(site)) for p in (site / "fedbroker").rglob("*.py")}
    # the installed copy only: no checkout on the path (cwd is tmp_path), the venv's site-packages for the
    # dependencies
    return Installed(site, tmp_path, {**_no_fedbroker_settings(), "PYTHONPATH": str(site)})


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_provision_runs_from_an_installed_wheel_and_its_overlay_renders(installed):
    """The Kubernetes base must ship inside the package: the server kit's overlay is copied from it."""
    tmp_path, env = installed.cwd, installed.env
    where = subprocess.run([sys.executable, "-c", "import fedbroker.app.provision as p; print(p.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip().startswith(str(installed.site)), where
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(PROJECT))
    run = subprocess.run([sys.executable, "-m", "fedbroker", "provision", "project.yaml", "--out", "kits"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rendered = subprocess.run([tool("kubectl"), "kustomize", str(tmp_path / "kits/server")], capture_output=True,
                              text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    names = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(rendered.stdout) if d}
    assert {("Deployment", "fedbroker-coordinator"), ("Deployment", "fedbroker-aggregator"),
            ("StatefulSet", "rabbitmq"), ("Service", "fedbroker-public-broker")} <= names


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_installed_command_reports_its_version_and_runs_the_demo(installed):
    """The console script pip wrote (not `python -m` on a checkout): its version is the wheel's metadata (the
    namespace has no __init__ to hold one), and the demo finishes a round from the installed copy alone."""
    command = str(installed.site / "bin" / "fedbroker")
    version = subprocess.run([command, "--version"], cwd=installed.cwd, env=installed.env, capture_output=True,
                             text=True, timeout=120)
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (version.returncode, version.stdout) == (0, f"fedbroker {expected}\n"), version
    runs = installed.cwd / "runs"
    # the smallest demo: two workers, one round of one epoch, no DP (no accountant), the in-process bus
    demo = subprocess.run([command, "demo", "--rounds", "1", "--workers", "2", "--local-epochs", "1", "--no-dp",
                           "--partition", "iid", "--out", str(runs)], cwd=installed.cwd, env=installed.env,
                          capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    (run_dir,) = runs.iterdir()
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["status"] == "completed" and results["summary"]["broker"] == "in-process"
    assert [(r["round"], r["clients"]) for r in results["rounds"]] == [(1, 2)]
    assert "final federated accuracy" in demo.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_server_launcher_stops_both_and_fails_when_the_coordinator_fails_at_start(tmp_path):
    """kits/server/start.sh with a coordinator that exits at once (a config error): the aggregation service
    is stopped too and the launcher exits with the coordinator's status, instead of waiting on a half server."""
    ports = {"coordinator_port": free_port(), "aggregator_port": free_port(), "broker_port": free_port()}
    provision(parse_project({"name": "launch", "server": {"host": "localhost", "listen": "127.0.0.1", **ports,
                                                          "aggregator_metrics_port": 0, "coordinator_metrics_port": 0},
                             "sites": [{"name": "s"}]}), tmp_path / "kits")
    server = tmp_path / "kits/server"
    with open(server / "coordinator.yaml", "a") as fh:
        fh.write("bogus: 1\n")  # refused at start: `bogus: unknown setting`, exit 2
    pids = tmp_path / "pids"
    pids.mkdir()
    wrapper = tmp_path / "fedbroker.sh"  # records each service's pid (it execs: the pid is the service's)
    wrapper.write_text(f'#!/bin/sh\necho $$ > "{pids}/$1"\nexec {sys.executable} -m fedbroker "$@"\n')
    env = {**_no_fedbroker_settings(), "FEDBROKER": f"sh {wrapper}", "PYTHONPATH": PYTHONPATH}
    launcher = subprocess.Popen([str(server / "start.sh")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = launcher.communicate(timeout=300)  # a hang guard only: the fixed launcher returns at once
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
            launcher.wait()
    assert launcher.returncode == 2, output.decode(errors="replace")
    assert b"bogus: unknown setting" in output
    for name in ("aggregator", "coordinator"):
        if (pids / name).exists():  # absent only if start.sh stopped it before its wrapper ran
            assert not _alive(int((pids / name).read_text())), f"the {name} still runs"
