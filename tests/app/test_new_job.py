"""`fedbroker new`: each template is a job the coordinator's own submission parser accepts, it is the example
job it says it comes from, and every setting in it carries a comment."""

from __future__ import annotations

import re

import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.app.new import TEMPLATES
from fedbroker.job.submission import accept_job_text
from tests.source_roots import ROOT

# each template and the example job it is written from (None: the bundled-digits variant of the CNN example)
SOURCES = {"sync": "examples/image-cnn-idx/job.yaml", "async": "examples/image-cnn-idx/job.yaml",
           "alignment": "examples/one-shot-fusion/job-pfnm.yaml", "own-data": "examples/tabular-csv-dwfed/job.yaml"}


def test_every_kind_the_command_offers_has_a_template_and_a_source():
    assert set(TEMPLATES) == set(SOURCES) == {"sync", "async", "alignment", "own-data"}


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_each_template_passes_the_coordinators_submission_parser(kind):
    job = accept_job_text(TEMPLATES[kind])  # what SubmitJob runs on the text it receives
    assert job.schedule.mode == ("async" if kind == "async" else "sync")
    if kind == "alignment":
        assert job.aggregation.alignment == "pfnm"


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_each_template_is_the_example_it_comes_from(kind):
    job = accept_job_text(TEMPLATES[kind])
    example = accept_job_text((ROOT / SOURCES[kind]).read_text())
    assert job.model == example.model
    if kind in ("alignment", "own-data"):  # the same job, with comments: the whole of it, every section
        assert job == example


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_every_setting_in_a_template_is_commented(kind):
    uncommented = [line for line in TEMPLATES[kind].splitlines()
                   if re.match(r"^\s*[a-z_]+:", line) and "#" not in line]
    assert not uncommented, uncommented
    assert yaml.safe_load(TEMPLATES[kind])  # the comments leave it plain YAML


def test_new_prints_to_stdout_or_writes_a_file_it_never_overwrites_unasked(tmp_path, capsys):
    assert main(["new"]) == 0
    assert capsys.readouterr().out == TEMPLATES["sync"]
    out = tmp_path / "job.yaml"
    assert main(["new", "own-data", "--out", str(out)]) == 0
    assert out.read_text() == TEMPLATES["own-data"]
    assert "fedbroker simulate" in capsys.readouterr().err
    assert main(["new", "async", "--out", str(out)]) == 2
    assert "fedbroker new: config: --out: " in capsys.readouterr().err and out.read_text() == TEMPLATES["own-data"]
    assert main(["new", "async", "--out", str(out), "--force"]) == 0
    assert out.read_text() == TEMPLATES["async"]
    assert main(["new", "sync", "--out", str(tmp_path)]) == 2  # a folder, not a file
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        main(["new", "fancy"])
    assert bad.value.code == 2 and "invalid choice: 'fancy'" in capsys.readouterr().err
