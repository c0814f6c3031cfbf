from __future__ import annotations

import pytest

from fedbroker.config import load_config
from fedbroker.errors import ConfigError


def test_environment_overrides_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("broker: {url: 'amqp://a'}\nworker: {id: w1, dp: {noise_multiplier: 1.0}}\n")
    config = load_config(str(path), environ={"FEDBROKER__WORKER__DP__NOISE_MULTIPLIER": "1.3",
                                             "FEDBROKER__WORKER__DP__DELTA": "1e-06",
                                             "FEDBROKER__WORKER__CATEGORIES": "digits,wine"})
    assert config.broker.url == "amqp://a" and config.worker.id == "w1"
    assert config.worker.dp.noise_multiplier == 1.3 and config.worker.dp.delta == 1e-6
    assert config.worker.categories == ("digits", "wine")


def test_flags_override_the_environment():
    config = load_config(environ={"FEDBROKER__WORKER__ID": "env"}, overrides={"worker.id": "flag", "broker.url": None})
    assert config.worker.id == "flag" and config.broker.url == ""


@pytest.mark.parametrize("key, value, field", [
    ("FEDBROKER__WORKER__DP__NOISE", "1", "worker.dp.noise"),
    ("FEDBROKER__WORKER__DP__DELTA", "tiny", "worker.dp.delta"),
    ("FEDBROKER__WORKER__DP__ENABLED", "3", "worker.dp.enabled"),
    ("FEDBROKER__AGGREGATOR__MAX_UPDATE_BYTES", "lots", "aggregator.max_update_bytes"),
])
def test_bad_settings_name_the_field(key, value, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(environ={key: value})


def test_the_worker_dp_policy_is_checked_when_it_is_on_and_only_then():
    with pytest.raises(ConfigError, match=r"dp\.delta: must lie strictly between 0 and 1"):
        load_config(environ={"FEDBROKER__WORKER__DP__DELTA": "2"})
    config = load_config(environ={"FEDBROKER__WORKER__DP__DELTA": "2", "FEDBROKER__WORKER__DP__ENABLED": "false"})
    assert not config.worker.dp.enabled and config.worker.dp.delta == 2.0


def test_worker_torch_threads_is_set_for_the_process_and_checked():
    import torch

    from fedbroker.app.launch import set_torch_threads
    from fedbroker.errors import ConfigError

    config = load_config(environ={"FEDBROKER__WORKER__TORCH_THREADS": "1"})
    assert config.worker.torch_threads == 1
    before = torch.get_num_threads()
    try:
        set_torch_threads(config.worker.torch_threads)
        assert torch.get_num_threads() == 1
        set_torch_threads(0)  # torch's default: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="worker.torch_threads"):
        set_torch_threads(-2)


@pytest.mark.parametrize("written, mode", [("true", "site"), ("false", "none"), ("site", "site"),
                                           ("federated", "federated"), ("none", "none")])
def test_data_standardize_reads_a_mode_and_the_booleans_of_older_configs(tmp_path, written, mode):
    path = tmp_path / "c.yaml"
    path.write_text(f"worker: {{data: {{standardize: {written}}}}}\n")
    assert load_config(str(path)).worker.data.standardize == mode
    assert load_config(environ={"FEDBROKER__WORKER__DATA__STANDARDIZE": written}).worker.data.standardize == mode


def test_an_unknown_standardize_mode_is_refused_naming_the_setting_and_the_modes():
    with pytest.raises(ConfigError, match="worker.data.standardize: must be 'none' or 'site' or 'federated'"):
        load_config(environ={"FEDBROKER__WORKER__DATA__STANDARDIZE": "global"})
    with pytest.raises(ConfigError, match="worker.data.standardize: must be"):
        load_config(environ={"FEDBROKER__WORKER__DATA__STANDARDIZE": "3"})


def test_a_sites_releases_are_noised_by_default():
    worker = load_config(environ={}).worker
    assert worker.histogram_epsilon == 1.0 and worker.statistics_epsilon == 1.0
    exact = load_config(environ={"FEDBROKER__WORKER__HISTOGRAM_EPSILON": "0"}).worker
    assert exact.histogram_epsilon == 0.0  # exact counts: the owner's explicit choice
