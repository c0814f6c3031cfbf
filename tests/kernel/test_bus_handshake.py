"""A broker connection's handshake on a loaded machine: pika cuts TCP + TLS + AMQP setup at 15 s and the link
starts over, so a handshake that needs longer never completes (a site's worker exited after two such cuts).
Each attempt now has as long as a call waits for it; pika's own limit is the floor, the URL's option wins."""

from __future__ import annotations

from dataclasses import replace

from fedbroker.bus.amqp_link import LinkSettings, _connection_parameters
from fedbroker.retry import Backoff

SETTINGS = LinkSettings(url="amqps://site:secret@localhost:5671/%2F", client_name="t", heartbeat_s=30,
                        blocked_timeout_s=45, reconnect=Backoff(initial_s=0.5, max_s=30))


def test_a_connection_attempt_may_take_as_long_as_a_call_waits_for_it() -> None:
    assert _connection_parameters("publisher", SETTINGS).stack_timeout == 45
    assert _connection_parameters("consumer", replace(SETTINGS, blocked_timeout_s=1)).stack_timeout == 15


def test_the_urls_own_stack_timeout_wins() -> None:
    url = SETTINGS.url + "?stack_timeout=5"
    assert _connection_parameters("publisher", replace(SETTINGS, url=url)).stack_timeout == 5
