"""The operator's view of the sites (ListSites, SiteDetail, SiteLogs) is for scientists and viewers: a site's token
is refused (it would learn the other sites' data shapes, DP policies and ε), and so is a call without a token.
What a site wrote is printed without its control characters: a hostile site cannot drive the operator's terminal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedbroker.app.sites import follow_logs, list_table, log_line, show_text
from fedbroker.bus import InProcessBus
from fedbroker.config import DPPolicy
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.coordinator.site_views import list_sites_reply, site_detail_reply
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from tests.security.conftest import token_table

IDENTITIES = {"site-a": "worker", "sci": "submitter", "eve": "viewer"}
ESCAPES = "\x1b[2J\x1b]0;owned\x07\r\u202e"


def hostile(store: StateStore) -> None:
    store.upsert_worker(worker_id="site-a", categories=["digits"], histogram=(), dp=DPPolicy(epsilon_budget=8.0),
                        epsilon_spent=1.5, device="cpu", num_samples=10, input_shape=[4], num_classes=2)
    store.note_registration("site-a", software_version="0.1.0", started=1.0, broker_user="site-a", summary="s")
    store.note_site_event("site-a", "failed", f"round 1 of job j: {ESCAPES}boom", error=True)
    store.add_site_log("site-a", sender="site-a", claimed="", site_time=1.0, level="WARNING",
                       logger=f"x{ESCAPES}", message=f"disk{ESCAPES}full", dropped_before=0)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[StateStore, int, dict[str, str]]]:
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    hostile(store)
    coordinator = Coordinator(bus=InProcessBus(namespace="sites-view"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    table, tokens = token_table(IDENTITIES)
    server, port = serve(coordinator, tokens=table)
    try:
        yield store, port, tokens
    finally:
        server.stop(grace=0)
        store.close()


def client(port: int, token: str) -> CoordinatorClient:
    return CoordinatorClient(f"127.0.0.1:{port}", security=ClientSecurity(token=token), timeout_s=10)


def test_scientists_and_viewers_see_the_sites_and_a_site_does_not(served: Any) -> None:
    _, port, tokens = served
    for who in ("sci", "eve"):
        c = client(port, tokens[who])
        try:
            assert [s.worker_id for s in c.list_sites().sites] == ["site-a"]
            assert c.site_detail("site-a").site.epsilon_recorded == 1.5
            assert len(c.site_logs("site-a").records) == 1
        finally:
            c.close()
    for token, code in ((tokens["site-a"], grpc.StatusCode.PERMISSION_DENIED), ("", grpc.StatusCode.UNAUTHENTICATED)):
        c = client(port, token)
        try:
            for call in (c.list_sites, lambda: c.site_detail("site-a"), lambda: c.site_logs("site-a")):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == code
        finally:
            c.close()


def test_nothing_a_site_wrote_reaches_the_terminal_as_a_control_character(served: Any) -> None:
    store, _, _ = served
    shown = "\n".join([list_table(list_sites_reply(store, heartbeat_timeout_s=60.0)),
                       show_text(site_detail_reply(store, "site-a", heartbeat_timeout_s=60.0)),
                       *(log_line(r) for r in (pb.SiteLogRow(message=f"disk{ESCAPES}full", logger=ESCAPES, level=ESCAPES,
                                                             sender=ESCAPES, claimed=ESCAPES),))])
    controls = {"\x1b", "\x07", "\r", "\u202e"}
    assert not set(shown) & controls, sorted(set(shown) & controls)
    assert "boom" in shown and "disk" in shown  # the text is there, only its controls are not
    assert "\x1b" not in json.dumps("\x1b")  # and --json escapes them by itself


def test_following_a_sites_logs_asks_again_after_the_last_record_it_printed() -> None:
    class Fake:
        def __init__(self) -> None:
            self.asked: list[int] = []
            self.pages = [[1, 2], [], [3]]

        def site_logs(self, site: str, *, after: int, limit: int) -> pb.SiteLogsReply:
            self.asked.append(after)
            if not self.pages:
                raise KeyboardInterrupt  # the operator's Ctrl-C
            return pb.SiteLogsReply(records=[pb.SiteLogRow(seq=s, message=f"m{s}") for s in self.pages.pop(0)])

    fake = Fake()
    got: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        for r in follow_logs(fake, "site-a", follow=True, limit=5, sleep=lambda s: None):
            got.append(r.seq)
    assert got == [1, 2, 3] and fake.asked == [0, 2, 2, 3]
