"""The demo's and simulate's progress: bars on a terminal, one plain line per round or version elsewhere (a
file, a pipe), never a line of carriage returns; rounds or versions as the job's own mode says."""

from __future__ import annotations

import io

from tqdm import tqdm

from fedbroker.app.progress import dp_policy, follow
from fedbroker.proto import fedbroker_pb2 as pb


def snapshots(mode: str) -> list[pb.StatusReply]:
    """What the coordinator answers, poll by poll: round 1 open, round 1 closed and 2 open, both closed."""
    replies = []
    for closed, opened, status in ((0, 1, "running"), (1, 2, "running"), (2, 0, "completed")):
        reply = pb.StatusReply()
        reply.jobs.add(job_id="j", status=status, rounds_done=closed, rounds_total=2, mode=mode)
        for n in range(1, closed + 1):
            reply.rounds.add(job_id="j", round=n, status="closed", participants=3, uploaded=3, aggregated=2 + n,
                             accuracy=0.5 + n / 10, loss=0.9, seconds=1.5, model_version=n + 1, mean_staleness=n / 4)
        if opened:
            reply.rounds.add(job_id="j", round=opened, status="open", participants=3, uploaded=1)
        replies.append(reply)
    return replies


class Script:
    def __init__(self, replies: list[pb.StatusReply]) -> None:
        self.replies = replies

    def status(self, job_id: str) -> pb.StatusReply:
        return self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]


class Alive:
    def check_alive(self) -> None:
        pass


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_each_round_is_one_plain_line():
    out = io.StringIO()
    status = follow(Script(snapshots("sync")), "j", Alive(), tqdm, stream=out, poll_s=0)
    assert status.jobs[0].status == "completed"
    assert "\r" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "round 1/2 closed: 3/3 uploads, 3 aggregated, accuracy 0.600 (1.5s)",
        "round 2/2 closed: 3/3 uploads, 4 aggregated, accuracy 0.700 (1.5s)",
    ]


def test_an_asynchronous_job_shows_versions_and_staleness():
    out = io.StringIO()
    follow(Script(snapshots("async")), "j", Alive(), tqdm, stream=out, poll_s=0)
    assert out.getvalue().splitlines() == [
        "version 2 (1/2): 3 update(s), mean staleness 0.25, accuracy 0.600 (1.5s)",
        "version 3 (2/2): 4 update(s), mean staleness 0.50, accuracy 0.700 (1.5s)",
    ]


def test_on_a_terminal_the_rounds_are_bars():
    out = Terminal()
    follow(Script(snapshots("sync")), "j", Alive(), tqdm, stream=out, poll_s=0)
    text = out.getvalue()
    assert "\r" in text and "round 1/2" in text and "round 2/2" in text and "accuracy 0.700" in text
    out = Terminal()
    follow(Script(snapshots("async")), "j", Alive(), tqdm, stream=out, poll_s=0)
    assert "versions" in out.getvalue() and "staleness 0.50" in out.getvalue()


def test_the_dp_policy_is_stated_in_full():
    assert dp_policy(enabled=True, noise_multiplier=1.3, max_grad_norm=1.0, delta=1e-5, epsilon_budget=10) == (
        "on (σ=1.3, clip=1, δ=1e-05, ε budget 10 per worker)")
    assert dp_policy(enabled=False, noise_multiplier=1.3, max_grad_norm=1.0, delta=1e-5, epsilon_budget=10) == "off"


def test_a_round_no_one_scored_shows_no_accuracy_and_a_sites_score_shows_as_such():
    replies = snapshots("sync")
    for reply in replies:
        for r in reply.rounds:
            r.accuracy, r.loss = 0.0, 0.0  # no evaluation set at the coordinator
    replies[-1].rounds[1].federated_accuracy, replies[-1].rounds[1].federated_samples = 0.8, 90
    out = io.StringIO()
    follow(Script(replies), "j", Alive(), tqdm, stream=out, poll_s=0)
    assert out.getvalue().splitlines() == [
        "round 1/2 closed: 3/3 uploads, 3 aggregated (1.5s)",
        "round 2/2 closed: 3/3 uploads, 4 aggregated, site acc 0.800 (1.5s)",
    ]
