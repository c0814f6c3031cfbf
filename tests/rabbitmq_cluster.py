"""A private three-node RabbitMQ cluster for tests that kill a node (tests/ha, bench/broker_cluster.py).

Each node is a `PrivateRabbitMQ` (tests/rabbitmq_node.py: its own folder, loopback ports, no plugins, none of the
machine's RabbitMQ settings); the three share one epmd and one Erlang cookie of this session's own, so they can
reach each other and nothing else can reach them. They form the cluster on boot from their config
(`classic_config` peer discovery: the first node starts alone, the other two join it), with
`cluster_partition_handling = pause_minority` as a production cluster runs. A node is killed with SIGKILL to its
beam (`kill`), as a machine's loss would; `stop` ends every process the cluster started, by pid.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.rabbitmq_node import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    WATCHDOG,
    PrivateRabbitMQ,
    missing,
    server_scripts,
)

NODES = 3


class ClusterNode(PrivateRabbitMQ):
    """One node of a private cluster: the cluster's epmd and cookie, its peers in its config."""

    killed = False

    def join(self, *, epmd_port: int, cookie: str, peers: list[str]) -> None:
        """Use the cluster's epmd and cookie, and find `peers` on boot (before `start`)."""
        self.env["ERL_EPMD_PORT"] = str(epmd_port)
        self.epmd_port = epmd_port
        cookie_file = Path(self.env["HOME"]) / ".erlang.cookie"
        cookie_file.chmod(0o600)
        cookie_file.write_text(cookie)
        cookie_file.chmod(0o400)
        lines = [f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}",
                 "cluster_partition_handling = pause_minority",
                 "cluster_formation.peer_discovery_backend = classic_config",
                 *(f"cluster_formation.classic_config.nodes.{i} = {peer}" for i, peer in enumerate(peers, 1))]
        (self.base / "rabbitmq.conf").write_text("\n".join(lines) + "\n")

    def start_member(self) -> None:
        """Start the node on the cluster's running epmd (the first node's): a member in a process group of its
        own with a watchdog of its own; the first node, revived, back in its epmd's group, whose watchdog guards
        it (so `stop` ends it as it ends the first start)."""
        epmd_group = self._epmd.pid if self._epmd is not None else 0  # 0: a new group
        with open(self.base / "server.out", "ab") as out:
            self._server = subprocess.Popen(self.server_command(), env=self.env, cwd=self.base,
                                            process_group=epmd_group, stdout=out, stderr=subprocess.STDOUT)
        if not epmd_group:
            previous, group = self._watchdog, self._server.pid
            self._watchdog = subprocess.Popen(["sh", "-c", WATCHDOG, str(os.getpid()), str(group)],
                                              process_group=group, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if previous is not None:  # it guarded the killed start's group, empty now
                previous.kill()
                previous.wait(10)
        self._await(self.answers, "AMQP to answer", self._server)

    def revive(self) -> None:
        """Start a killed node again from its own folder: it rejoins the cluster with what it held, as a lost
        machine brought back does (the quorum queues it was a member of catch it up)."""
        assert self.killed, f"{self.name} was not killed"
        if self._server is not None:
            self._server.wait(STOP_TIMEOUT_S)  # its start script ends with the killed beam
        self.start_member()
        self.killed = False

    @property
    def beam_pid(self) -> int | None:
        """The node's Erlang VM (from its pid file), what a kill -9 hits."""
        return self._beam_pid()

    def kill(self) -> None:
        """SIGKILL to the node's beam: no shutdown, its connections reset, as a lost machine."""
        pid = self.beam_pid
        assert pid is not None, f"node {self.name} wrote no pid file\n{self.log_tail()}"
        os.kill(pid, signal.SIGKILL)
        self.killed = True

    def stop(self) -> None:
        """The first node: as a private node (its group holds epmd); a member: its beam, then its group."""
        if self._epmd is not None:
            super().stop()
            return
        server = self._server
        if server is None:
            return
        beam = self.beam_pid
        for pid in (beam, server.pid):
            try:
                if pid:
                    os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                server.wait(STOP_TIMEOUT_S if sig == signal.SIGTERM else 10.0)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(server.pid, sig)
            except ProcessLookupError:
                break
            if self._reaped(STOP_TIMEOUT_S if sig == signal.SIGTERM else 10.0):
                break


class PrivateCluster:
    """Three clustered private nodes; `urls` lists their AMQP URLs, `url` is the comma-separated broker.url."""

    def __init__(self, root: Path) -> None:
        scripts = server_scripts()
        if shutil.which("epmd") is None:
            missing("epmd (Erlang's port mapper, part of erlang-base) is not on PATH: a private RabbitMQ needs it")
        self.nodes = [ClusterNode(root / f"node{i}", scripts) for i in range(NODES)]
        cookie = secrets.token_hex(20)
        peers = [node.name for node in self.nodes]
        for node in self.nodes:
            node.join(epmd_port=self.nodes[0].epmd_port, cookie=cookie, peers=peers)

    @property
    def urls(self) -> list[str]:
        """Each node's AMQP URL (guest, from loopback)."""
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """The cluster as one `broker.url`: the first node's URL, the others as host:port."""
        return ",".join([self.nodes[0].url, *(f"127.0.0.1:{n.amqp_port}" for n in self.nodes[1:])])

    def start(self) -> None:
        """The first node alone, then the other two at once (they join it on boot); returns once all three are
        running members of one cluster. RuntimeError (with the logs) otherwise; the caller stops it either way."""
        self.nodes[0].start()
        errors: list[BaseException] = []

        def member(node: ClusterNode) -> None:
            try:
                node.start_member()
            except BaseException as exc:  # re-raised below, in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=member, args=(node,)) for node in self.nodes[1:]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"a cluster member did not start: {errors[0]}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.running()) < NODES:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster has {self.running()} running\n"
                                   + "\n".join(n.log_tail(1500) for n in self.nodes))
            time.sleep(0.5)

    def running(self, via: ClusterNode | None = None) -> list[str]:
        """The running members' names, as `via` (default: the first live node) sees them."""
        node = via or self.alive()[0]
        status = json.loads(node.ctl("cluster_status", "--formatter", "json"))
        return sorted(status.get("running_nodes", []))

    def alive(self) -> list[ClusterNode]:
        """The nodes not killed."""
        return [node for node in self.nodes if not node.killed]

    def leaders(self, via: ClusterNode | None = None) -> dict[str, str]:
        """Each quorum queue's leader (queue name → node name), from rabbitmqctl on `via` (default: a live node)."""
        return {name: leader for name, (leader, _) in self.quorum_queues(via).items()}

    def quorum_queues(self, via: ClusterNode | None = None) -> dict[str, tuple[str, list[str]]]:
        """Each quorum queue's leader and its members online now (queue name → (leader, online members)), in one
        rabbitmqctl call on `via` (default: a live node)."""
        node = via or self.alive()[0]
        rows = node.ctl("list_queues", "name", "type", "leader", "online", "-q", "--no-table-headers")
        out = {}
        for line in rows.splitlines():
            parts = line.split("\t")
            if len(parts) == 4 and parts[1] == "quorum":
                out[parts[0]] = (parts[2], [m.strip() for m in parts[3].strip("[]").split(",") if m.strip()])
        return out

    def revive(self) -> None:
        """Every killed node started again (`ClusterNode.revive`); returns once all three are running members, so
        a case that kills a node finds a whole cluster whatever the case before it killed."""
        for node in self.nodes:
            if node.killed:
                node.revive()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(self.running()) < NODES:
            assert time.monotonic() < deadline, f"the cluster has {self.running()} running after a revival\n" + \
                "\n".join(n.log_tail(1500) for n in self.nodes)
            time.sleep(0.5)

    def node_named(self, name: str) -> ClusterNode:
        """The node RabbitMQ calls `name`."""
        return next(node for node in self.nodes if node.name == name)

    def stop(self) -> None:
        """Every node, members first (the first node's group holds the shared epmd)."""
        for node in reversed(self.nodes):
            node.stop()


def start_private_cluster(root: Path) -> PrivateCluster:
    """A running three-node cluster under `root`, or a failed test with its logs (stopped either way)."""
    cluster = PrivateCluster(root)
    try:
        cluster.start()
        return cluster
    except RuntimeError as exc:
        cluster.stop()
        pytest.fail(f"a private RabbitMQ cluster did not start:\n{exc}", pytrace=False)
    except BaseException:
        cluster.stop()
        raise
