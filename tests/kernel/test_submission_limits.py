"""What is refused at submission so that no worker spends ε on a job that cannot run: an evaluation section
the coordinator cannot evaluate, a training step too large for any worker's memory, a name with a trailing
newline, and YAML whose parsing would cost far more than its size (merge-key chains, alias bombs)."""

from __future__ import annotations

import resource
from typing import Any

import pytest

from fedbroker.bus.base import check_name
from fedbroker.config import load_config
from fedbroker.datasets import load_dataset
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import (
    EVALUATION_SETS,
    MAX_SPEC_BYTES,
    MAX_STEP_BYTES,
    EvaluationConfig,
    JobSpec,
    TrainingConfig,
    job_from_text,
    parse_job,
    step_bytes,
)
from fedbroker.job.yamltext import MAX_ALIASES, MAX_MERGES, load_yaml

DIGITS_MODEL = {"input_shape": [1, 8, 8], "layers": [
    {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]}


def job(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "j", "category": "digits", "model": DIGITS_MODEL}
    out.update(changes)
    return out


def problems(raw: dict[str, Any]) -> str:
    with pytest.raises((ConfigError, ConfigErrors)) as info:
        parse_job(raw)
    return str(info.value)


# ----- evaluation -----------------------------------------------------------------------------------------

def test_the_evaluation_table_matches_the_data_sets_a_worker_loads() -> None:
    for name, (shape, classes) in EVALUATION_SETS.items():
        data = load_dataset(name)
        assert (data.input_shape, data.num_classes) == (shape, classes), name


@pytest.mark.parametrize(("evaluation", "text"), [
    ({"dataset": "nope"}, "evaluation.dataset: must be '' or 'digits'"),
    ({"dataset": "mnist"}, "evaluation.dataset: must be '' or 'digits'"),   # needs files the coordinator lacks
    ({"dataset": "digits", "split_seed": -1}, "evaluation.split_seed: must be in [0, 4294967295], got -1"),
    ({"dataset": "digits", "split_seed": 2**40}, "evaluation.split_seed: must be in [0, 4294967295]"),
    ({"dataset": "wine"}, "evaluation.dataset: 'wine' has samples of shape [13] but model.input_shape is [1, 8, 8]"),
])
def test_an_evaluation_section_that_cannot_be_evaluated_is_refused_at_submission(evaluation: dict[str, Any],
                                                                                   text: str) -> None:
    assert text in problems(job(evaluation=evaluation))


def test_an_evaluation_set_with_more_classes_than_the_model_outputs_is_refused() -> None:
    model = {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                  {"type": "Linear", "in_features": 64, "out_features": 3}]}
    assert "'digits' has 10 classes but the model outputs 3 scores" in problems(
        job(model=model, evaluation={"dataset": "digits"}))


def test_a_valid_evaluation_section_is_accepted_and_a_spec_built_in_python_is_checked_too() -> None:
    spec = parse_job(job(evaluation={"dataset": "digits", "split_seed": 7}))
    assert spec.evaluation == EvaluationConfig(dataset="digits", split_seed=7)
    with pytest.raises(ConfigError, match="evaluation.dataset: 'iris' has samples of shape"):
        JobSpec(name="j", category="digits", model=spec.model, training=spec.training,
                aggregation=spec.aggregation, schedule=spec.schedule, evaluation=EvaluationConfig(dataset="iris"))


# ----- one training step's memory -------------------------------------------------------------------------

def test_a_training_step_larger_than_the_limit_is_refused_naming_the_batch_that_fits() -> None:
    # ~0.8 M parameters: with DP's per-sample gradients a batch of 65,536 asks for ~200 GB
    model = {"input_shape": [784], "layers": [{"type": "Linear", "in_features": 784, "out_features": 1000},
                                              {"type": "ReLU"}, {"type": "Linear", "in_features": 1000,
                                                                 "out_features": 10}]}
    text = problems(job(model=model, training={"batch_size": 65_536}))
    assert "training.batch_size: 65536 makes one training step need" in text and "GiB" in text, text
    spec = parse_job(job(model=model, training={"batch_size": 64}))
    assert step_bytes(model=spec.model, training=spec.training) <= MAX_STEP_BYTES
    fits = int(text.rsplit("use a batch of at most ", 1)[1])
    assert step_bytes(model=spec.model, training=TrainingConfig(batch_size=fits)) <= MAX_STEP_BYTES
    assert step_bytes(model=spec.model, training=TrainingConfig(batch_size=fits + 1)) > MAX_STEP_BYTES


def test_step_memory_counts_the_input_every_layer_output_and_the_per_sample_gradients() -> None:
    spec = parse_job(job())
    per_sample = 64 + 64 + 10 + (64 * 10 + 10)   # input, Flatten, Linear, and its weight and bias
    assert step_bytes(model=spec.model, training=TrainingConfig(batch_size=32)) == 4 * 32 * per_sample


# ----- names ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["job\n", "job\r\n", "\njob", "jo\nb"])
def test_a_name_with_a_newline_is_refused_everywhere_names_are_checked(name: str) -> None:
    assert "name: is required" in problems(job(name=name))
    assert "category: is required" in problems(job(category=name))
    with pytest.raises(ConfigError, match="worker_id: must be 1-128 characters"):
        check_name("worker_id", name)


def test_a_token_table_name_or_digest_with_a_trailing_newline_is_refused() -> None:
    from fedbroker.rpc.auth import TokenTable

    digest = "a" * 64
    with pytest.raises(ConfigError):
        TokenTable.from_mapping({"w1\n": {"role": "worker", "sha256": digest}}, where="tokens")
    with pytest.raises(ConfigError, match="sha256"):
        TokenTable.from_mapping({"w1": {"role": "worker", "sha256": digest + "\n"}}, where="tokens")
    TokenTable.from_mapping({"w1": {"role": "worker", "sha256": digest}}, where="tokens")


# ----- YAML that costs more than its size -----------------------------------------------------------------

def merge_key_chain(target_bytes: int) -> str:
    """Each mapping merges the one before it: PyYAML's merge copies every earlier key into every later
    mapping, so the work grows with the square of the text (249 KB took 52 s and 933 MB)."""
    lines = ["name: chain", "category: digits", "k0: &k0 {a0: 0}"]
    i = 1
    while sum(len(line) + 1 for line in lines) < target_bytes:
        lines.append(f"k{i}: &k{i} {{<<: *k{i - 1}, a{i}: {i}}}")
        i += 1
    return "\n".join(lines) + "\n"


def test_a_249_kb_merge_key_chain_is_refused_naming_the_merge_keys_with_little_memory() -> None:
    text = merge_key_chain(249_000)
    assert 240_000 < len(text) <= MAX_SPEC_BYTES   # under the size limit: only the bound on merges stops it
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match=f"job: uses more than {MAX_MERGES} YAML merge keys"):
        job_from_text(text)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100 * 1024   # the unbounded parse grew the process by ~900 MB


def test_aliases_beyond_the_bound_are_refused_and_a_few_are_still_accepted() -> None:
    few = "name: j\ncategory: digits\nmodel: &m " + '{"input_shape": [4], "layers": [{"type": "Linear", ' \
          '"in_features": 4, "out_features": 2}]}\nx: *m\n'
    with pytest.raises(ConfigError, match="x: unknown field"):   # parsed: only the unknown field is wrong
        job_from_text(few)
    many = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(ConfigError, match=f"uses more than {MAX_ALIASES} YAML aliases"):
        load_yaml(many, where="job", max_bytes=MAX_SPEC_BYTES)


def test_the_size_is_checked_in_bytes_before_parsing() -> None:
    text = "name: " + "é" * (MAX_SPEC_BYTES // 2 + 1)   # under the limit in characters, over it in bytes
    with pytest.raises(ConfigError, match=f"job: is larger than {MAX_SPEC_BYTES} bytes"):
        job_from_text(text)


def test_a_config_file_with_a_merge_key_chain_is_refused_too(tmp_path: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("worker: &w {id: a}\n" + "".join(f"x{i}: &x{i} {{<<: *{'w' if i == 0 else f'x{i - 1}'}}}\n"
                                                     for i in range(MAX_MERGES + 1)), encoding="utf-8")
    with pytest.raises(ConfigError, match="YAML merge keys"):
        load_config(str(path), environ={})
