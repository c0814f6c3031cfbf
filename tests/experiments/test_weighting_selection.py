"""The base-model experiment's GA arms: valid jobs, and a probe set that is no worker's data and not the test set."""

from __future__ import annotations

from experiments.weighting_selection import GAProtocol, ga_arms, ga_tasks, make_task_split
from fedbroker.datasets import load_dataset
from fedbroker.job.submission import accept_job


def test_every_ga_arm_is_a_job_the_service_accepts_with_the_fitness_it_names():
    protocol = GAProtocol(seeds=(0,))
    assert ga_arms(protocol) == ["random", "ga (probe)", "ga (reported_loss)"]
    for task in ga_tasks(protocol):
        job = accept_job(dict(task.job))
        params = job.aggregation.selection_params
        if task.key[2] == "random":
            assert job.aggregation.selection == "random"
        else:
            assert params["fitness"] == task.key[2][len("ga ("):-1]
            assert ("probe_dataset" in params) == (params["fitness"] == "probe")


def test_the_probe_set_is_taken_out_of_the_training_split_before_the_workers_get_it():
    task = next(t for t in ga_tasks(GAProtocol(seeds=(1,))) if t.key[2] == "ga (probe)")
    workers, test, probe = make_task_split(task)
    assert probe is not None and len(probe) == GAProtocol().probe_size
    assert set(probe.y.tolist()) == set(range(10))  # stratified: every class
    held = sum(len(w.y) for w in workers)
    assert held + len(probe) + len(test) == len(load_dataset("digits"))
    # the random arm of the same seed sees the very same workers (paired design)
    same = next(t for t in ga_tasks(GAProtocol(seeds=(1,))) if t.key[2] == "random")
    others, _, _ = make_task_split(same)
    assert [len(w.y) for w in others] == [len(w.y) for w in workers]
