"""A cluster's broker addresses and quorum queue settings, without a broker: the list `broker.url` may hold, its
masking in logs, the queue arguments each queue type declares, and the config check (tests/ha has the cluster)."""

from __future__ import annotations

import pytest

from fedbroker.bus import AmqpBus
from fedbroker.bus.amqp_link import Link, LinkSettings
from fedbroker.bus.amqp_topology import TopologyDeclarer
from fedbroker.bus.base import Topology, broker_urls, check_url, mask_url
from fedbroker.config import load_config
from fedbroker.errors import ConfigError
from fedbroker.retry import Backoff

CLUSTER = "amqp://site:s3cret@h1:5672/proj?heartbeat=10,h2:5673, amqps://site:s3cret@h3/proj"


def test_bare_host_items_reuse_the_first_urls_credentials_vhost_and_options() -> None:
    assert broker_urls(CLUSTER) == ("amqp://site:s3cret@h1:5672/proj?heartbeat=10",
                                    "amqp://site:s3cret@h2:5673/proj?heartbeat=10",
                                    "amqps://site:s3cret@h3/proj")
    assert broker_urls("amqp://u:p@h/%2F") == ("amqp://u:p@h/%2F",)


def test_a_list_is_masked_item_by_item_and_an_unescaped_comma_in_a_password_never_shows() -> None:
    assert "s3cret" not in mask_url(CLUSTER) and "h2:5673" in mask_url(CLUSTER) and "h3" in mask_url(CLUSTER)
    broken = "amqp://site:zq9,xk7@h1:5672/%2F"  # an unescaped ',' splits the password into two items
    assert "zq9" not in mask_url(broken) and "xk7" not in mask_url(broken)
    with pytest.raises(ConfigError, match="%2C") as refused:
        broker_urls(broken)
    assert "zq9" not in str(refused.value) and "xk7" not in str(refused.value)
    assert check_url(CLUSTER) == CLUSTER


def test_every_address_must_log_in_as_one_user() -> None:
    with pytest.raises(ConfigError, match="same user"):
        AmqpBus("amqp://a:p@h1/%2F,amqp://b:p@h2/%2F")


def test_the_link_rotates_to_the_next_node_at_once_and_backs_off_after_a_full_round() -> None:
    settings = LinkSettings(url="amqp://u:p@h1/%2F,h2,h3", client_name="t", heartbeat_s=30, blocked_timeout_s=30,
                            reconnect=Backoff(initial_s=1, max_s=1))
    link = Link(role="publisher", settings=settings, on_connect=lambda conn: None, on_disconnect=lambda: None)
    moves = [link._next_node(failures)[::-1] + (link.node,) for failures in range(6)]
    assert [(delay > 0, node) for delay, _, node in moves] == [
        (False, 1), (False, 2), (True, 0), (False, 1), (False, 2), (True, 0)]
    assert "h1" in link.masked_url


def test_quorum_queues_carry_the_delivery_limit_and_at_least_once_dead_lettering() -> None:
    classic = TopologyDeclarer(Topology("t"))
    assert classic.consumer_queue_arguments() == {"x-dead-letter-exchange": "t.dlx"}
    quorum = TopologyDeclarer(Topology("t"), queue_type="quorum", max_attempts=3, consumer_timeout_s=60)
    assert quorum.consumer_queue_arguments() == {
        "x-dead-letter-exchange": "t.dlx", "x-queue-type": "quorum", "x-delivery-limit": 2,
        "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}
    assert quorum.task_consumer_arguments == {"x-consumer-timeout": 60000}
    with pytest.raises(ConfigError, match="queue_type"):
        TopologyDeclarer(Topology("t"), queue_type="mirrored")


def test_the_config_takes_quorum_and_names_a_wrong_queue_type() -> None:
    assert load_config(environ={}).broker.queue_type == "classic"  # make demo and single nodes: unchanged
    assert load_config(environ={}, overrides={"broker.queue_type": "quorum"}).broker.queue_type == "quorum"
    with pytest.raises(ConfigError, match="broker.queue_type"):
        load_config(environ={}, overrides={"broker.queue_type": "mirrored"})
