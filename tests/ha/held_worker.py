"""`fedbroker worker`, as the aggregation failover case runs one site: it holds its task of round HOLD_ROUND
(before training it, so nothing is spent) until the file HOLD_RELEASE exists, and says it holds by writing
HOLD_RELEASE's sibling `holding-<worker id>`.

    FEDBROKER_TEST_HOLD_RELEASE=/tmp/x/release FEDBROKER_TEST_HOLD_ROUND=1 python -m tests.ha.held_worker worker

The production worker has no such door: only this entry point, which lives with the tests, opens it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from fedbroker.app.cli import main as fedbroker_main
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent


def hold(release: Path, round_number: int) -> None:
    """Make every WorkerAgent of this process wait for `release` before it trains round `round_number`."""
    train = WorkerAgent._train

    def held(self: WorkerAgent, task: pb.RoundTask, *args: Any, **kwargs: Any) -> Any:
        if task.round == round_number:
            (release.parent / f"holding-{self.config.id}").touch()
            while not release.exists():
                time.sleep(0.05)
        return train(self, task, *args, **kwargs)

    WorkerAgent._train = held  # type: ignore[method-assign]


def main() -> int:
    hold(Path(os.environ["FEDBROKER_TEST_HOLD_RELEASE"]), int(os.environ["FEDBROKER_TEST_HOLD_ROUND"]))
    return fedbroker_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
