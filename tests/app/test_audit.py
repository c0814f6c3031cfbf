from __future__ import annotations

import numpy as np
import pytest

from fedbroker.app.audit import loss_threshold_auc, per_sample_loss
from fedbroker.job.spec import parse_model
from fedbroker.model import initial_weights


def test_attack_auc_is_one_when_members_have_lower_loss_and_half_when_indistinguishable():
    assert loss_threshold_auc(np.array([0.1, 0.2]), np.array([0.5, 0.9])) == 1.0
    assert loss_threshold_auc(np.array([0.9, 0.5]), np.array([0.1, 0.2])) == 0.0
    same = np.random.default_rng(0).exponential(size=4000)
    assert loss_threshold_auc(same[:2000], same[2000:]) == pytest.approx(0.5, abs=0.03)


def test_per_sample_loss_is_the_cross_entropy_of_each_sample():
    spec = parse_model({"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 2}]})
    tensors = initial_weights(spec, seed=0)
    x = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    y = np.array([0, 1, 1, 0, 1])
    logits = x @ tensors["0.weight"].T + tensors["0.bias"]
    expected = np.log(np.exp(logits).sum(1)) - logits[np.arange(5), y]
    np.testing.assert_allclose(per_sample_loss(spec.to_json(), tensors, x, y), expected, rtol=1e-5)
