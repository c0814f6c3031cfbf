"""The allowed layer types, in one table: adding a layer type means adding one entry to LAYERS.

Each entry (`fedbroker.layers.base.LayerType`) says what the rest of the project needs to know about a type:
its parameters and their bounds, the shape it outputs for a given input (or why it cannot take that input),
its parameter tensors by state_dict suffix, how torch builds it, how neuron alignment treats it and how DP
training clips it. Spec validation (`fedbroker.job.model_spec`), the torch builder (`fedbroker.model`),
alignment (`fedbroker.job.submission`, `fedbroker.aggregators.layer_conversion`) and the docs' table all read
this table. The entries live by family (dense, conv, pool, norm, sequence, and library: the MONAI networks a node
may name, built by `fedbroker.layers.monai_nets`); no torch here: the coordinator and
the aggregator validate models without it (the torch modules are in `fedbroker.layers.modules`).
"""

from __future__ import annotations

from collections.abc import Mapping

from fedbroker.layers.base import LayerType, Param, ParamKind, Params, Shape, ShapeProblem, check_param, check_values
from fedbroker.layers.conv import CONV
from fedbroker.layers.dense import DENSE
from fedbroker.layers.library import LIBRARY
from fedbroker.layers.norm import NORM, batchnorm_groups
from fedbroker.layers.pool import POOL
from fedbroker.layers.sequence import SEQUENCE

LAYERS: Mapping[str, LayerType] = {**DENSE, **CONV, **POOL, **NORM, **SEQUENCE, **LIBRARY}

__all__ = ["LAYERS", "LayerType", "Param", "ParamKind", "Params", "Shape", "ShapeProblem", "batchnorm_groups",
           "check_param", "check_values"]
