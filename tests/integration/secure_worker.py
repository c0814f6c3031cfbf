"""`fedbroker worker`, as a test runs it to watch a secure round from inside a site (test_secure_round.py).

    python -m tests.integration.secure_worker [--record DIR] [--exit-at STEP] worker [fedbroker worker flags]

The worker is the one `fedbroker worker` builds (fedbroker.app.cli.cmd_worker, its settings from FEDBROKER__
variables), with a `SecureSteps` recorder injected: it writes each clear weighted update, just before it is
masked, to DIR as `<job>-<round>-<worker>.npz` (what the test compares the service's sum with), and exits the
process with status 17 (with --kill: by SIGKILL) once STEP (`masked` or `uploaded`) is done, as a site that crashes
there would. The
production worker has no such door: only this entry point, which lives with the tests, opens it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedbroker.app.cli import build_parser, cmd_worker
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.secure_task import Step

log = logging.getLogger(__name__)

CRASH_STATUS = 17


class Recorder:
    """Records the clear updates and crashes at one step (see the module docstring)."""

    def __init__(self, *, folder: Path | None, exit_at: Step | None, kill: bool = False) -> None:
        self.folder, self.exit_at, self.kill = folder, exit_at, kill

    def clear_update(self, *, worker_id: str, task: pb.RoundTask, vector: np.ndarray, scale: float) -> None:
        if self.folder is not None:
            np.savez(self.folder / f"{task.job_id}-{task.round}-{worker_id}.npz", vector=vector,
                     scale=np.float64(scale))

    def step_done(self, *, worker_id: str, task: pb.RoundTask, step: Step) -> None:
        if step == self.exit_at:
            log.warning("worker %s exits after step %r (a test's crash)", worker_id, step)
            logging.shutdown()
            if self.kill:  # as the kernel's OOM killer or an operator's kill -9 would: no handler runs
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(CRASH_STATUS)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="secure_worker")
    parser.add_argument("--record", type=Path, help="folder for the clear weighted updates")
    parser.add_argument("--exit-at", choices=["masked", "uploaded"], help="the step after which to crash")
    parser.add_argument("--kill", action="store_true", help="crash by SIGKILL instead of exiting with status 17")
    ours, rest = parser.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    if args.command != "worker":
        parser.error(f"runs only `worker`, not {args.command!r}")
    return cmd_worker(args, secure_steps=Recorder(folder=ours.record, exit_at=ours.exit_at, kill=ours.kill))


if __name__ == "__main__":
    sys.exit(main())
