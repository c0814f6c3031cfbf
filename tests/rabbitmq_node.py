"""RabbitMQ for tests that break it, and a read-only look at the machine's own broker.

A test that stops, restarts or reconfigures a broker (its settings, users or vhosts) does it to a node of its
session's own: its own directory, cookie, config and loopback ports, its own epmd, stopped by pid at the end. The
machine's broker (the one a developer's deployment may use) is only ever published to and read from, and
`machine_broker_state` lets the suite check that it was left exactly as it was found.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest

SCRIPTS_ENV = "FEDBROKER_RABBITMQ_SBIN"  # folder holding RabbitMQ's own rabbitmq-server and rabbitmqctl scripts
MACHINE_CTL_ENV = "FEDBROKER_RABBITMQCTL"  # how to reach the machine's broker, e.g. 'docker exec rabbitmq rabbitmqctl'
START_TIMEOUT_S = 180.0  # a cold start takes about 12 s on a loaded 2-core machine
STOP_TIMEOUT_S = 60.0


def missing(message: str) -> NoReturn:
    """A RabbitMQ tool that is not installed skips a test on a developer's machine and fails it on CI."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def server_scripts() -> Path:
    """The folder of RabbitMQ's real scripts: Debian's /usr/sbin ones switch to the rabbitmq user and its HOME
    (the machine's cookie), so a private node runs the scripts they wrap, as the current user."""
    candidates = [os.environ.get(SCRIPTS_ENV, ""), "/usr/lib/rabbitmq/bin"]
    found = shutil.which("rabbitmq-server")
    if found and Path(found).resolve().name == "rabbitmq-server":
        candidates.append(str(Path(found).resolve().parent))
    for folder in filter(None, candidates):
        if (Path(folder) / "rabbitmq-server").is_file() and (Path(folder) / "rabbitmqctl").is_file():
            return Path(folder)
    missing(f"RabbitMQ's rabbitmq-server and rabbitmqctl scripts were not found (install rabbitmq-server, or set "
            f"{SCRIPTS_ENV} to the folder holding them): the tests that stop or reconfigure a broker start their own")


LOWEST_PORT = 10_000  # below: well-known and registered services' ports


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections and `bind(0)` (Linux: 32768-60999 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports free now, taken from below the kernel's ephemeral range: a port that is written
    into a config (a kit's broker URL) and bound seconds or minutes later can then never be taken meanwhile by
    an outgoing connection, which draws from that range (seen: a kit's AMQPS port taken during a full run).
    Each is bound while the others are chosen, so they differ; a random draw keeps two runs apart."""
    low, _ = _ephemeral_range()
    if low - LOWEST_PORT < 1000:  # no room below the range on this machine: let the kernel choose
        return _kernel_ports(count)
    draw = secrets.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", draw.randrange(LOWEST_PORT, low)))
            except OSError:  # in use: draw again
                s.close()
                continue
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _kernel_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


# What the node's logs say when a port chosen free was taken before it bound it: AMQP, distribution, epmd.
PORT_TAKEN = ("eaddrinuse", "dist_port_already_used", "there is already a epmd running")

# A watchdog in the node's process group: if pytest dies without its teardown (SIGKILL, SIGTERM), it stops the
# node, its epmd and itself, so no run leaves a beam behind.
WATCHDOG = 'while kill -0 "$0" 2>/dev/null; do sleep 1; done; kill -TERM -"$1"'


class PrivateRabbitMQ:
    """One RabbitMQ node owned by this test session; `start()` it, `stop()` it (always, also after a failure)."""

    def __init__(self, base: Path, scripts: Path) -> None:
        self.base = base
        self.scripts = scripts
        self.name = f"fbtest-{os.getpid()}-{secrets.token_hex(3)}@localhost"
        self.amqp_port, dist_port, self.epmd_port = free_ports(3)
        self.url = f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/%2F"
        self.env = self._environment(dist_port)
        self.log = base / "log" / "node.log"
        self._epmd: subprocess.Popen[bytes] | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None

    def _environment(self, dist_port: int) -> dict[str, str]:
        """Every path and port of the node in its own folder; none of the machine's RabbitMQ or Erlang settings
        (/etc/rabbitmq/rabbitmq-env.conf names the machine's node) and none of its plugins (management would
        take port 15672)."""
        home, base = self.base / "home", self.base
        home.mkdir(parents=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20))
        cookie.chmod(0o400)
        (base / "rabbitmq-env.conf").write_text("")
        (base / "rabbitmq.conf").write_text(f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}\n")
        (base / "enabled_plugins").write_text("[].\n")
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        return {
            **inherited,
            "HOME": str(home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(dist_port),
            "ERL_EPMD_PORT": str(self.epmd_port),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "RABBITMQ_CTL_DIST_PORT_MIN": "0",  # rabbitmqctl's own node on any free port, not 35672-35682
            "RABBITMQ_CTL_DIST_PORT_MAX": "0",
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_LOGS": str(base / "log" / "node.log"),
            "RABBITMQ_PID_FILE": str(base / "node.pid"),
        }

    def start(self) -> None:
        """Start epmd, the watchdog and the node in one new process group (out of the terminal's way: Ctrl-C
        reaches pytest, whose teardown stops them); return once AMQP answers and rabbitmqctl reaches the node.
        Raises RuntimeError (with the node's log) if it does not come up; the caller stops it either way."""
        with open(self.base / "epmd.out", "wb") as out:
            self._epmd = subprocess.Popen(["epmd", "-d", "-d", "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                                          env=self.env, process_group=0, stdout=out, stderr=subprocess.STDOUT)
        group = self._epmd.pid
        self._watchdog = subprocess.Popen(["sh", "-c", WATCHDOG, str(os.getpid()), str(group)],
                                          process_group=group, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._await(self._epmd_listens, "its epmd to listen", self._epmd)
        with open(self.base / "server.out", "wb") as out:
            self._server = subprocess.Popen(self.server_command(), env=self.env, cwd=self.base,
                                            process_group=group, stdout=out, stderr=subprocess.STDOUT)
        self._await(self.answers, "AMQP to answer", self._server)
        # then rabbitmqctl must reach it (cookie, epmd): the tests stop and reconfigure it with rabbitmqctl
        started = self._run_ctl("await_startup", "--timeout", str(int(START_TIMEOUT_S)), timeout=START_TIMEOUT_S + 30)
        if started.returncode != 0:
            raise RuntimeError(f"rabbitmqctl await_startup said: {started.stdout}{started.stderr}\n{self.log_tail()}")

    def server_command(self) -> list[str]:
        """What starts the node (with `env`, in `base`)."""
        return [str(self.scripts / "rabbitmq-server")]

    def _await(self, ready: Callable[[], bool], what: str, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if process.poll() is not None:
                raise RuntimeError(f"{process.args!r} exited with {process.returncode} before {what}\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"waited {START_TIMEOUT_S:g} s for {what}\n{self.log_tail()}")
            time.sleep(0.1)

    def _epmd_listens(self) -> bool:
        """Whether epmd has bound its port: its debug output says so (an epmd that finds the port taken, by
        anything, exits instead; a connection test could reach whatever holds the port)."""
        return "entering the main select() loop" in (self.base / "epmd.out").read_text(errors="replace")

    def answers(self) -> bool:
        """Whether the node accepts an AMQP connection now (its application is running)."""
        import pika

        params = pika.URLParameters(self.url)
        params.connection_attempts = 1
        params.socket_timeout = 2
        try:
            pika.BlockingConnection(params).close()
            return True
        except Exception:  # refused, reset, timed out: not answering
            return False

    def _run_ctl(self, *args: str, timeout: float, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.scripts / "rabbitmqctl"), "-n", self.name, *args], env=self.env,
                              input=stdin, capture_output=True, text=True, timeout=timeout)

    def ctl(self, *args: str, timeout: float = 60.0, stdin: str | None = None) -> str:
        """rabbitmqctl against this node; its output, or an assertion naming the command and what it said."""
        done = self._run_ctl(*args, timeout=timeout, stdin=stdin)
        assert done.returncode == 0, f"rabbitmqctl -n {self.name} {shlex.join(args)}: {done.stdout} {done.stderr}"
        return done.stdout.strip()

    def close_connection(self, connection_name: str) -> None:
        """Have the node close a client's connection (found by its connection_name), as a network cut would."""
        listing = self.ctl("list_connections", "pid", "client_properties", "-q", "--no-table-headers")
        marker = f'{{"connection_name","{connection_name}"}}'
        pids = [line.split("\t")[0] for line in listing.splitlines() if marker in line]
        assert pids, f"no connection named {connection_name} in:\n{listing}"
        for pid in pids:
            self.ctl("close_connection", pid, "fedbroker test: connection cut")

    def provision(self, *, namespace: str, participants: Sequence[str]) -> dict[str, str]:
        """Each participant's AMQP URL on this node, as its own broker user (`<namespace>-<participant>`) with
        exactly what `fedbroker provision` lets it do ("coordinator": the coordinator; any other name: a site),
        from the kit's own definitions (fedbroker.app.provision.configs.broker_definitions). The import is
        asynchronous from RabbitMQ 3.12: each user is waited for until it logs in."""
        from fedbroker.app.provision.configs import broker_definitions
        from fedbroker.app.provision.project import Project

        passwords = {who: secrets.token_urlsafe(12) for who in participants}
        definitions = broker_definitions(Project(name=namespace, host="localhost", namespace=namespace), passwords)
        urls = {who: f"amqp://{namespace}-{who}:{pw}@127.0.0.1:{self.amqp_port}/%2F" for who, pw in passwords.items()}
        self.import_users(definitions, urls)
        return urls

    def import_users(self, definitions: dict[str, Any], urls: dict[str, str]) -> None:
        """Broker users and their permissions (definitions.json's) in ONE rabbitmqctl call, each call being an Erlang
        VM's start (seconds on a loaded machine, past a minute on a loaded 2-core one), then each user of `urls`
        waited for until it logs in (the import is asynchronous from RabbitMQ 3.12)."""
        self.ctl("import_definitions", "--format", "json", stdin=json.dumps(definitions), timeout=START_TIMEOUT_S)
        for who, url in urls.items():
            deadline = time.monotonic() + START_TIMEOUT_S
            while not _logs_in(url):
                assert time.monotonic() < deadline, f"broker user of {who} cannot log in\n{self.log_tail()}"
                time.sleep(0.2)

    def log_tail(self, chars: int = 4000) -> str:
        """The ends of epmd's, the start script's and the node's logs: what a failed start message shows."""
        logs = (self.base / "epmd.out", self.base / "server.out", self.log)
        texts = [p.read_text(errors="replace")[-chars:] for p in logs if p.exists()]
        return f"--- log of {self.name} in {self.base}:\n" + "\n".join(texts)

    def stop(self) -> None:
        """SIGTERM to the node's beam (a clean shutdown), then to its process group: epmd and the watchdog."""
        server, group = self._server, self._epmd.pid if self._epmd else None
        if server is not None and server.poll() is None:
            beam = self._beam_pid()
            try:
                os.kill(beam or server.pid, signal.SIGTERM)
                server.wait(STOP_TIMEOUT_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if group is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    break
                if self._reaped(STOP_TIMEOUT_S if sig == signal.SIGTERM else 10.0):
                    break

    def _beam_pid(self) -> int | None:
        try:
            return int((self.base / "node.pid").read_text().strip())
        except (OSError, ValueError):
            return None

    def _reaped(self, timeout: float) -> bool:
        """Wait for every process this node started; whether all are gone."""
        for process in (self._server, self._watchdog, self._epmd):
            if process is None:
                continue
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
        return True


def _logs_in(url: str) -> bool:
    import pika

    params = pika.URLParameters(url)
    params.connection_attempts, params.socket_timeout = 1, 5
    try:
        pika.BlockingConnection(params).close()
        return True
    except Exception:  # refused (not imported yet), reset: not yet
        return False


def start_private_rabbitmq(root: Path, *, attempts: int = 3,
                           configure: Callable[[PrivateRabbitMQ], None] | None = None) -> PrivateRabbitMQ:
    """A started private node under `root`. A port chosen free may be taken by another process before the node
    binds it: such a start is retried on new ports. Any other failure fails the test with the node's log.
    `configure(node)` may add to the node's files (`node.base`: rabbitmq.conf, advanced.config) before it starts."""
    scripts = server_scripts()
    if shutil.which("epmd") is None:
        missing("epmd (Erlang's port mapper, part of erlang-base) is not on PATH: a private RabbitMQ node needs it")
    failures: list[str] = []
    for attempt in range(1, attempts + 1):
        node = PrivateRabbitMQ(root / f"node{attempt}", scripts)
        try:
            if configure is not None:
                configure(node)
            node.start()
            return node
        except RuntimeError as exc:
            node.stop()
            failures.append(f"attempt {attempt}: {exc}")
            if not any(marker in str(exc) for marker in PORT_TAKEN):
                break  # not a port taken meanwhile: trying again would fail the same way, minutes later
        except BaseException:  # KeyboardInterrupt, a pytest timeout: never leave a half-started node behind
            node.stop()
            raise
    pytest.fail("a private RabbitMQ node did not start:\n" + "\n".join(failures), pytrace=False)


# ----- the machine's broker: read-only -----------------------------------------------------------------

# The node's OS pid (a restart changes it), the rabbit application's supervisor (a stop_app/start_app changes it)
# and the settings tests used to lower there.
MACHINE_STATE = ('{os:getpid(), case whereis(rabbit_sup) of undefined -> not_running; Sup -> pid_to_list(Sup) end, '
                 'application:get_env(rabbit, consumer_timeout), application:get_env(rabbit, channel_tick_interval)}.')
MACHINE_STATE_FIELDS = "{OS pid, rabbit application's supervisor, consumer_timeout, channel_tick_interval}"
# No test adds, changes or deletes a user (with its tags) or a vhost there, not even for a moment: a test that
# needs users of its own imports them into its private node. Two suites at once leave these lists alone too.
MACHINE_LISTINGS = ("list_users", "list_vhosts")
UNTOUCHED_CHECK = "test_the_suite_neither_restarts_nor_reconfigures_the_machines_broker"  # runs last


def machine_broker_state() -> dict[str, str]:
    """The machine broker's identity and settings as Erlang prints them (`rabbitmqctl eval`, which changes
    nothing), and its users and vhosts, one sorted line each; RuntimeError if they cannot be read."""
    command = shlex.split(os.environ.get(MACHINE_CTL_ENV, "rabbitmqctl"))
    if not shutil.which(command[0]):
        raise RuntimeError(f"{command[0]} not found; set {MACHINE_CTL_ENV} (e.g. 'docker exec rabbitmq rabbitmqctl')")
    state = {MACHINE_STATE_FIELDS: _read_machine(command, "eval", MACHINE_STATE)}
    for listing in MACHINE_LISTINGS:
        lines = _read_machine(command, "-q", listing, "--no-table-headers").splitlines()
        state[listing] = "\n".join(sorted(lines))
    return state


def _read_machine(command: list[str], *args: str) -> str:
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join([*command, *args])} failed: {done.stdout} {done.stderr}")
    return done.stdout.strip()


# ----- a server kit's broker, run as a host operator runs it ---------------------------------------------------


class KitBroker(PrivateRabbitMQ):
    """A RabbitMQ node run as a host operator runs the server kit's broker: by the kit's start-broker.sh (the kit's
    rabbitmq.conf, advanced.config with TLS and the CRL check, enabled_plugins; the kit's node name and
    distribution port), with this session's own epmd, cookie (HOME) and folders, so the machine's broker is out of
    its reach. It answers when `site` (a site's kit) logs in over AMQPS with its client certificate and broker URL.
    `env` is the broker's host's environment: RabbitMQ's own scripts first on PATH (`rabbitmqctl` the real one),
    so a `fedbroker broker sync` line runs there as printed."""

    def __init__(self, kit: Path, scripts: Path, site: Path) -> None:
        super().__init__(kit, scripts)  # the node's own files (home, mnesia, log) go into the kit's folder
        from fedbroker.app.provision.configs import broker_node
        from fedbroker.app.provision.lifecycle import summary

        self.site = site
        self.name = broker_node(summary(kit.parent).to_project())   # what start-broker.sh names it
        for name in ("RABBITMQ_NODENAME", "RABBITMQ_DIST_PORT", "RABBITMQ_NODE_PORT", "RABBITMQ_NODE_IP_ADDRESS",
                     "RABBITMQ_CONFIG_FILE", "RABBITMQ_ADVANCED_CONFIG_FILE", "RABBITMQ_ENABLED_PLUGINS_FILE"):
            self.env.pop(name)   # the kit's start script sets these, its config names the listener
        self.env.update(RABBITMQ_SERVER=str(scripts / "rabbitmq-server"),
                        PATH=os.pathsep.join([str(scripts), self.env.get("PATH", "")]))

    def server_command(self) -> list[str]:
        return [str(self.base / "start-broker.sh")]

    def answers(self) -> bool:
        try:
            amqps(self.site).close()
            return True
        except Exception:  # refused, reset, handshake not yet possible: not answering
            return False


def amqps(kit: Path, *, certificate: bool = True, cert_of: Path | None = None) -> Any:
    """A pika connection as a site's worker makes it: its kit's broker URL, verifying the broker against its
    kit's CA, presenting its kit's client certificate (or `cert_of`'s, another kit's; none: `certificate=False`)."""
    import ssl

    import pika

    params = pika.URLParameters((kit / "secrets/broker-url").read_text().strip())
    params.connection_attempts, params.socket_timeout = 1, 10
    params.stack_timeout = 300  # a hang guard: pika's 15 s cut a TLS handshake the loaded broker was still doing
    context = ssl.create_default_context(cafile=str(kit / "ca.crt"))
    if certificate:
        holder = cert_of or kit
        context.load_cert_chain(str(holder / "tls/client.crt"), str(holder / "tls/client.key"))
    params.ssl_options = pika.SSLOptions(context, "localhost")
    return pika.BlockingConnection(params)
