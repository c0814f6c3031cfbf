"""The demo's and simulate's progress while a job runs, and the DP policy their first line states.

On a terminal: a tqdm bar per round (uploads of participants), or one bar of versions for an asynchronous job.
Elsewhere (a file, a pipe, CI) a bar is a line of carriage returns: then one plain line per round or version as
it ends. Whether the job has rounds or versions is the job's own `mode`, as the coordinator reports it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from fedbroker.app.replies import job_status, round_status
from fedbroker.job.status import FINISHED, RoundStatus

if TYPE_CHECKING:
    from fedbroker.proto import fedbroker_pb2 as pb


def dp_policy(*, enabled: bool, noise_multiplier: float, max_grad_norm: float, delta: float,
              epsilon_budget: float) -> str:
    """`on (σ=…, clip=…, δ=…, ε budget … per worker)` or `off`: the policy every worker trains under."""
    if not enabled:
        return "off"
    return (f"on (σ={noise_multiplier:g}, clip={max_grad_norm:g}, δ={delta:g}, ε budget {epsilon_budget:g} "
            f"per worker)")


def site_metric(r: Any) -> str:
    """The name of the sites' headline score of a round (the job's task: accuracy, macro_f1, mae, dice)."""
    return "acc" if r.federated_metric in ("", "accuracy") else r.federated_metric


def score(r: Any) -> str:
    """A closed round's score as far as it is known: the coordinator's central accuracy, else the sites'
    federated one, else nothing (a job without an evaluation set is scored by its sites after the round closes:
    never a false 0.000)."""
    if r.loss > 0:  # a central evaluation's cross-entropy is never exactly 0
        return f"accuracy {r.accuracy:.3f}"
    if r.federated_samples:
        return f"site {site_metric(r)} {r.federated_accuracy:.3f}"
    return ""


def _round_line(r: Any, total: int) -> str:
    known = score(r) if round_status(r) is RoundStatus.CLOSED else ""
    score_text = f", {known}" if known else ""
    return (f"round {r.round}/{total} {r.status}: {r.uploaded}/{r.participants} uploads, {r.aggregated} aggregated"
            f"{score_text} ({r.seconds:.1f}s)")


def _version_line(r: Any, total: int) -> str:
    known = score(r)
    return (f"version {r.model_version} ({r.round}/{total}): {r.aggregated} update(s), mean staleness "
            f"{r.mean_staleness:.2f}{', ' + known if known else ''} ({r.seconds:.1f}s)")


class _Plain:
    """One line per round or version as it ends."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.said: set[int] = set()

    def show(self, status: Any, *, asynchronous: bool, total: int) -> None:
        for r in status.rounds:
            state = round_status(r)
            if state is not RoundStatus.OPEN and r.round not in self.said:
                self.said.add(r.round)
                print(_version_line(r, total) if asynchronous and state is RoundStatus.CLOSED else _round_line(r, total),
                      file=self.stream, flush=True)

    def close(self) -> None:
        """Nothing to close: every line is out."""


class _Bars:
    """tqdm bars: one per round (uploads of participants), or one of versions."""

    def __init__(self, tqdm: Any, stream: IO[str]) -> None:
        self.tqdm, self.stream = tqdm, stream
        self.rounds: dict[int, Any] = {}
        self.versions: Any = None

    def show(self, status: Any, *, asynchronous: bool, total: int) -> None:
        if asynchronous:
            self._versions(status, total)
            return
        for r in status.rounds:
            bar = self.rounds.get(r.round)
            if bar is None:
                # No rate: a round that closed between two polls would show thousands of uploads a second.
                bar = self.rounds[r.round] = self.tqdm(
                    total=r.participants, desc=f"round {r.round}/{total}", unit="upload", leave=True,
                    dynamic_ncols=True, file=self.stream,
                    bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} uploads [{elapsed}{postfix}]")
            if bar.disable:
                continue
            if r.uploaded != bar.n:
                bar.update(r.uploaded - bar.n)
            state = round_status(r)
            if state is not RoundStatus.OPEN:
                bar.set_postfix_str(score(r) if state is RoundStatus.CLOSED else r.status)
                bar.close()
                bar.disable = True

    def _versions(self, status: Any, total: int) -> None:
        if self.versions is None:
            self.versions = self.tqdm(total=total, desc="versions", unit="version", dynamic_ncols=True,
                                      file=self.stream)
        done = [r for r in status.rounds if round_status(r) is RoundStatus.CLOSED]
        if len(done) != self.versions.n:
            self.versions.update(len(done) - self.versions.n)
            known = score(done[-1])
            self.versions.set_postfix_str(f"{known + ', ' if known else ''}staleness {done[-1].mean_staleness:.2f}")

    def close(self) -> None:
        for bar in self.rounds.values():
            bar.close()
        if self.versions is not None:
            self.versions.close()


def follow(client: Any, job_id: str, cluster: Any, tqdm: Any, *, stream: IO[str] | None = None,
           poll_s: float = 0.25, observe: Callable[[], object] | None = None) -> pb.StatusReply:
    """Poll the coordinator until the job ends, showing its progress on `stream` (default stderr): bars on a
    terminal, plain lines elsewhere. `cluster.check_alive()` stops the wait when a process of it died;
    `observe` (MLflow tracking) is called once a poll."""
    out = stream if stream is not None else sys.stderr
    view: _Plain | _Bars = _Bars(tqdm, out) if out.isatty() else _Plain(out)
    try:
        while True:
            cluster.check_alive()
            if observe is not None:
                observe()
            status = client.status(job_id)
            job = status.jobs[0] if status.jobs else None
            if job is not None:
                view.show(status, asynchronous=job.mode == "async", total=job.rounds_total)
                if job_status(job) in FINISHED:
                    reply: pb.StatusReply = status
                    return reply
            time.sleep(poll_s)
    finally:
        view.close()


def run_tracked(cluster: Any, job_text: str, *, track: str | None, experiment: str,
                params: dict[str, str]) -> tuple[str, pb.StatusReply]:
    """The demo's and simulate's run: start `cluster`, submit the job, follow it to its end (logged to MLflow
    with `track`: `fedbroker.app.tracking.start`) and stop the cluster whatever happened. The job's id and its
    final status."""
    from tqdm import tqdm

    from fedbroker.app import tracking

    try:
        cluster.start()
        client = cluster.client()
        job_id: str = client.submit(job_text)
        tracker = tracking.start(track, client, job_id, experiment=experiment, params=params)
        observe = None if tracker is None else (lambda: tracker.sync(client))
        status = follow(client, job_id, cluster, tqdm, observe=observe)
        tracking.end(tracker, client)
        client.close()
    finally:
        cluster.stop()
    if tracker is not None:
        print(f"tracked in MLflow run {tracker.run_id} at {tracker.uri}")
    return job_id, status
