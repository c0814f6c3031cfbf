"""PostgreSQL for tests: a private server the tests own, and throwaway databases on the machine's.

A test that kills or restarts PostgreSQL does it to a server of its own (`PostgresNode`): its own data folder,
loopback port and socket folder, started with the machine's `initdb`/`pg_ctl` and killed by pid. A test that only
needs a database uses the machine's server (127.0.0.1:5432) through one it creates and drops itself
(`scratch_database`). Neither ever touches the machine's server settings or other databases.

PostgreSQL refuses to run as root, so under root the server runs as the `postgres` user (`runuser`), in a folder
it owns under the system's temporary directory (pytest's own folders are closed to other users).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.rabbitmq_node import free_ports, missing

MACHINE_URL_ENV = "FEDBROKER_TEST_POSTGRES"   # the machine's server, as a libpq URL without a database
MACHINE_URL = os.environ.get(MACHINE_URL_ENV, "postgresql://postgres@127.0.0.1:5432")
START_TIMEOUT_S = 60.0
SERVER_USER = "postgres"


def server_bin() -> Path:
    """The folder of the machine's PostgreSQL server programs (Debian: /usr/lib/postgresql/<major>/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parent.parent.name))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    missing("PostgreSQL's server programs (initdb, pg_ctl) were not found: install postgresql; the tests that "
            "restart a PostgreSQL start their own")


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", SERVER_USER, "--", *argv]


class PostgresNode:
    """A private PostgreSQL server on a loopback port: `start()`, `kill()` (SIGKILL of the postmaster, as a crash),
    `start()` again (crash recovery from its WAL), `stop()`. `url` reaches its `fedbroker` database."""

    def __init__(self) -> None:
        self.bin = server_bin()
        self.root = Path(tempfile.mkdtemp(prefix="fedbroker-pg-"))
        self.data = self.root / "data"
        (self.port,) = free_ports(1)
        if os.geteuid() == 0:
            entry = pwd.getpwnam(SERVER_USER)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._initdb()

    def _run(self, *argv: str) -> None:
        done = subprocess.run(_as_server_user([str(self.bin / argv[0]), *argv[1:]]), capture_output=True, text=True,
                              timeout=START_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")

    def _initdb(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "fedbroker", "-E", "UTF8", "--no-sync")

    @property
    def url(self) -> str:
        """The SQLAlchemy URL of the server's `fedbroker` database (created by the first `start`)."""
        return f"postgresql+psycopg://fedbroker@127.0.0.1:{self.port}/fedbroker"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"), "-w",
                  "-t", str(int(START_TIMEOUT_S)), "start")
        with contextlib.suppress(RuntimeError):  # exists after the first start
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "fedbroker", "fedbroker")

    def pid(self) -> int | None:
        """The postmaster's pid, or None when the server is not running."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends, as a crashed machine would leave them."""
        pid = self.pid()
        if pid is None:
            return
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()
        for victim in [pid, *(int(c) for c in children)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        with contextlib.suppress(FileNotFoundError):
            (self.data / "postmaster.pid").unlink()

    def stop(self) -> None:
        """Stop the server (fast) and remove its folder."""
        if self.pid() is not None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
            self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def private_postgres() -> Iterator[PostgresNode]:
    """A started private server, stopped and removed afterwards."""
    node = PostgresNode()
    try:
        node.start()
        yield node
    finally:
        node.stop()


@contextlib.contextmanager
def scratch_database() -> Iterator[str]:
    """A database of its own on the machine's PostgreSQL, created here and dropped afterwards: its SQLAlchemy URL.
    A machine without a reachable server skips the test, and fails it on CI."""
    import psycopg

    name = f"fedbroker_test_{secrets.token_hex(6)}"
    try:
        admin = psycopg.connect(f"{MACHINE_URL}/postgres", autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        missing(f"the machine's PostgreSQL at {MACHINE_URL} is unreachable ({exc}); set {MACHINE_URL_ENV}")
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield f"{MACHINE_URL.replace('postgresql://', 'postgresql+psycopg://', 1)}/{name}"
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.close()
