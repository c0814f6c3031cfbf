"""`fedbroker submit job.yaml [--json] [--follow | --wait]`: send a job, and optionally stay with it to its end.

The job is checked here first (the coordinator's own parser), so a bad one never travels. Without `--json`
the job's id is stdout's first line (`JOB=$(fedbroker submit job.yaml)`), and each site's projected ε and the
warnings go to stderr; with it, one JSON object `{"job_id", "warnings", "epsilon_projection"}`. `--follow` then streams the job's events as `fedbroker jobs logs
--follow` does (JSON lines with `--json`) and `--wait` waits without them; either way the exit code is the
job's end: 0 completed, 1 failed or cancelled (its error on stderr), 130 when interrupted (the job goes on).
With `--track [URI]` as well, the job is logged to MLflow while it runs (fedbroker.app.tracking).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import grpc

from fedbroker.app import tracking
from fedbroker.app.replies import job_status
from fedbroker.app.status import round_progress
from fedbroker.errors import ConfigError, FedbrokerError
from fedbroker.job.status import JobStatus

if TYPE_CHECKING:
    from fedbroker.job.spec import JobSpec


class JobDidNotComplete(FedbrokerError):
    """A followed job ended failed or cancelled: exit 1, its error in the message (origin `job`)."""

    reason = "job_failed"


def service_warnings(c: Any, job: JobSpec, job_id: str) -> list[str]:
    """What the coordinator's view says right after the submission: no active worker, or why the job waits.
    A caller that may not read the status gets no such warnings (the job was accepted all the same)."""
    try:
        status = c.status("")
    except grpc.RpcError:
        return []
    out = []
    if not any(w.active for w in status.workers):
        out.append(f"no worker is active at the coordinator: the job waits schedule.wait_for_workers_s "
                   f"({job.schedule.wait_for_workers_s:g}s) for {job.schedule.min_workers} worker(s) of category "
                   f"{job.category!r}, then fails")
    out += [f"the job waits: {j.waiting}" for j in status.jobs if j.job_id == job_id and j.waiting]
    return out


def start_file(job: JobSpec, *, job_path: str) -> bytes:
    """The start file the job pins (model.initial_weights; a relative path is the job file's neighbour), read
    here, on the data scientist's machine, checked against its pin and the model; b"" when it pins none."""
    from fedbroker.job.spec import parameter_shapes
    from fedbroker.weights.plan import raise_all
    from fedbroker.weights.start import decode, read_pinned, start_problems

    pinned = job.plan.initial_weights
    if pinned is None:
        return b""
    path = os.path.join(os.path.dirname(os.path.abspath(job_path)), os.path.expanduser(pinned.path))
    data = read_pinned(path, sha256=pinned.sha256)
    raise_all(start_problems(parameter_shapes(job.model), decode(data)))
    return data


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit the job file; print its id (and warnings); with --follow or --wait, stay to its end."""
    from fedbroker.app.jobs import client
    from fedbroker.job.model_spec import model_bounds
    from fedbroker.job.submission import accept_job_text

    try:
        with open(args.job, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("job", f"cannot read {args.job}: {getattr(exc, 'strerror', None) or exc}") from None
    job = accept_job_text(text)  # refuse a bad job here, before it travels
    weights = start_file(job, job_path=args.job)
    if args.track is not None and not (args.follow or args.wait):
        raise ConfigError("--track", "needs --follow or --wait (it logs the job while staying with it); to track a "
                                     "job without staying, run `fedbroker jobs track ID --follow`")
    tracking.check_store(args.track, experiment=args.experiment)  # MLflow missing or its store unreachable: refused before the job travels
    with client(args) as c:
        reply = c.submit_job(text, initial_weights=weights)
        job_id = reply.job_id
        warnings = [*reply.warnings, *service_warnings(c, job, job_id)]
        projection = list(reply.epsilon_projection)
        bounds = model_bounds(job.model)  # what each site's worker.limits will be compared with
        if args.json:
            print(json.dumps({"job_id": job_id, "warnings": warnings, "epsilon_projection": projection,
                              "model_bounds": dataclasses.asdict(bounds)}), flush=True)
        else:
            print(job_id, flush=True)
            print(f"fedbroker submit: model: {bounds.describe()}", file=sys.stderr)
            for line in projection:  # each site's ε after the job, if it trained every round, against its budget
                print(f"fedbroker submit: ε {line}", file=sys.stderr)
            for warning in warnings:
                print(f"fedbroker submit: warning: {warning}", file=sys.stderr)
        if args.follow or args.wait:
            tracker = tracking.start(args.track, c, job_id, experiment=args.experiment)
            if tracker is not None:  # stderr: stdout stays the id (and, with --json, JSON lines only)
                print(f"fedbroker submit: tracking in MLflow run {tracker.run_id} at {tracker.uri}", file=sys.stderr)
            return _stay(c, job_id, as_json=args.json, quiet=args.wait, tracker=tracker)
    return 0


def _stay(c: Any, job_id: str, *, as_json: bool, quiet: bool, tracker: tracking.JobTracker | None = None) -> int:
    """Stream (or, quiet, only wait for) the job's events until it ends, logging them to MLflow with a tracker;
    0 completed, else JobDidNotComplete."""
    from fedbroker.app.jobs import event_printer, follow_events, print_events

    if tracker is not None:
        tracking.track(c, tracker, follow=True, on_event=None if quiet else event_printer(c, job_id, as_json=as_json))
    elif quiet:
        for _ in follow_events(c, job_id, follow=True):
            pass
    else:
        print_events(c, job_id, as_json=as_json, follow=True)
    reply = c.status(job_id)
    (job,) = reply.jobs
    progress = round_progress(job, reply.rounds)
    if as_json:
        print(json.dumps({"job_id": job_id, "status": job.status, "rounds_done": job.rounds_done,
                          "rounds_total": job.rounds_total, "error": job.error}), flush=True)
    elif quiet:
        print(f"job {job_id} {job.status} ({progress})", flush=True)
    if job_status(job) is not JobStatus.COMPLETED:
        raise JobDidNotComplete(f"job {job_id} {job.status} after {progress}: "
                                f"{job.error or 'no error recorded'}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker submit` under the main parser's subcommands."""
    submit = sub.add_parser("submit", help="submit a job (YAML or JSON file); --follow to stream it to its end",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    submit.add_argument("job")
    submit.add_argument("--coordinator", help="host:port, or several comma-separated (a standby is passed over; default: coordinator.targets, else coordinator.target, 127.0.0.1:50052)")
    submit.add_argument("--config", help="YAML config with the client section (token, CA) and coordinator.target")
    submit.add_argument("--json", action="store_true",
                        help="print {job_id, warnings} as JSON (and the events as JSON lines with --follow)")
    stay = submit.add_mutually_exclusive_group()
    stay.add_argument("--follow", "-f", action="store_true",
                      help="stream the job's events until it ends; exit 0 if it completed, 1 if not")
    stay.add_argument("--wait", action="store_true",
                      help="wait until the job ends without its events; exit 0 if it completed, 1 if not")
    tracking.add_track_arguments(submit, what="the job")
    submit.set_defaults(run=cmd_submit)
