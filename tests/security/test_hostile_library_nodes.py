"""Library nodes' surfaces (deploy/SECURITY.md, "Library nodes"): a job asking a site for a huge MONAI network, for
an architecture or a parameter off the allow-list (MONAI's keyword arguments, a download), and sites or a
coordinator whose MONAI differs from the pinned version. Each job goes through `accept_job`, the coordinator's
intake."""

from __future__ import annotations

import resource

import monai
import pytest

from fedbroker.errors import ConfigError
from fedbroker.job.spec import parse_model
from fedbroker.job.submission import accept_job
from fedbroker.layers.library import MONAI_VERSION
from fedbroker.model import build_model
from tests.library_examples import LIBRARY_EXAMPLES


def _job(model: dict) -> dict:
    return {"name": "j", "category": "digits", "model": model,
            "aggregation": {"alignment": "none", "weighting": "fedavg", "selection": "all"}}


def _resnet(**params: object) -> dict:
    node = {"type": "monai.ResNet", "depth": 18, "spatial_dims": 2, "n_input_channels": 3, "num_classes": 4,
            "conv1_t_size": 3, "conv1_t_stride": 1, "no_max_pool": True, **params}
    return {"input_shape": [3, 16, 16], "nodes": {"net": node}}


def test_a_huge_monai_network_is_refused_at_submission_with_its_count_and_no_memory_spent() -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = {"input_shape": [1, 64, 64, 64], "nodes": {"net": {
        "type": "monai.UNet", "spatial_dims": 3, "in_channels": 1, "out_channels": 2, "channels": [1024] * 6,
        "strides": [2] * 5, "num_res_units": 4}}}
    with pytest.raises(ConfigError, match=r"^model\.nodes\.net: monai\.UNet with these parameters holds 1,104,419,956 "
                                          r"weights, more than a library node's limit of 100,000,000$"):
        accept_job(_job(model))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1_000_000  # KiB; 4.4 GB if built
    wide = {"input_shape": [1, 64, 64], "nodes": {"net": {
        "type": "monai.UNet", "spatial_dims": 2, "in_channels": 1, "out_channels": 2, "channels": [4096, 8192],
        "strides": [2], "num_res_units": 40}}}
    with pytest.raises(ConfigError) as info:
        accept_job(_job(wide))
    problems = {e.field for e in getattr(info.value, "errors", [info.value])}
    assert problems == {"model.nodes.net.channels", "model.nodes.net.num_res_units"}  # bounded before any build


@pytest.mark.parametrize(("params", "field"), [
    ({"pretrained": True}, "model.nodes.net.pretrained"),          # a download at the site
    ({"kwargs": {"block": "os.system"}}, "model.nodes.net.kwargs"),  # keyword arguments passed on to MONAI
    ({"norm": "batch"}, "model.nodes.net.norm"),                    # BatchNorm: samples mixed, no DP
    ({"act": ("relu", {"inplace": True})}, "model.nodes.net.act"),  # MONAI's (name, kwargs) form
])
def test_a_parameter_off_the_allow_list_is_refused_naming_it(params: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        accept_job(_job(_resnet(**params)))
    assert field in {e.field for e in getattr(info.value, "errors", [info.value])}


def test_an_architecture_off_the_allow_list_is_refused_naming_the_allowed_ones() -> None:
    model = {"input_shape": [1, 16, 16], "nodes": {"net": {"type": "monai.networks.nets.SwinUNETR"}}}
    with pytest.raises(ConfigError, match=r"model\.nodes\.net\.type: unknown node type .*monai\.UNet"):
        accept_job(_job(model))


def test_a_job_pinning_another_monai_version_is_refused_at_submission() -> None:
    with pytest.raises(ConfigError, match=rf'model\.nodes\.net\.version: must be one of "{MONAI_VERSION}", got "1\.5\.0"'):
        accept_job(_job(_resnet(version="1.5.0")))


def test_a_site_whose_monai_differs_refuses_to_build_the_model_naming_both_versions(monkeypatch) -> None:
    spec = parse_model(LIBRARY_EXAMPLES["monai.ViT"][0])
    monkeypatch.setattr(monai, "__version__", "1.7.0")
    with pytest.raises(ConfigError, match=rf"the model names MONAI {MONAI_VERSION}; this site has MONAI 1\.7\.0"):
        build_model(spec, seed=0)


def test_a_coordinator_whose_monai_differs_refuses_the_job(monkeypatch) -> None:
    monkeypatch.setattr(monai, "__version__", "1.7.0")
    with pytest.raises(ConfigError, match=rf"model\.nodes\.net: the model names MONAI {MONAI_VERSION}; this site has "
                                          r"MONAI 1\.7\.0"):
        accept_job(_job(_resnet(num_groups=7)))  # parameters not met before: the meta build (and its check) runs
