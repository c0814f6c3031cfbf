"""`python -m bench [--quick] [--only a,b] [--out DIR]`: run the benchmarks, write results.json and results.md.

Full mode (`make bench`) takes about 20 minutes on 2 cores, plus the DP models section (6b: about 7 minutes under load 17–23 on 2 shared cores); `--quick` (about 3 minutes) runs every
benchmark at small sizes, which is what tests/house/test_bench_quick.py checks. Flower's baselines need
`.venv-bench` (`make bench-env`); without it they are reported as missing, never faked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable

from bench.harness import Section, machine, write_results

BENCHMARKS = ("averaging", "streaming", "control_plane", "connected", "alignment", "genetic", "dp_training", "dp_models",
              "secagg", "secure_round", "secure_groups", "ddp_round", "robust", "graph_validation", "data_loading",
              "broker_cluster")
HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOTS = (".", "coordinator", "worker", "aggregators", "proto")  # the fedbroker namespace in a checkout
REPO = os.path.dirname(HERE)


def averaging(quick: bool) -> Section:
    """In `.venv-bench` when it exists, so Flower's aggregate runs in the same process as ours."""
    from bench.flower_env import bench_python

    python = bench_python()
    if python is None:
        from bench import averaging as module

        return module.run(quick=quick)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, "-m", "bench.averaging", "--json", out.name] + (["--quick"] if quick else [])
        subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": os.pathsep.join(os.path.join(REPO, r) for r in SOURCE_ROOTS)}, check=True)
        with open(out.name) as f:
            return Section.from_json("averaging", json.load(f))


def _module(name: str) -> Callable[[bool], Section]:
    def run(quick: bool) -> Section:
        module = __import__(f"bench.{name}", fromlist=["run"])
        return module.run(quick=quick)

    return run


RUNNERS: dict[str, Callable[[bool], Section]] = {
    "averaging": averaging,
    **{name: _module(name) for name in BENCHMARKS if name != "averaging"},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, about 2 minutes")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--out", default=HERE, help="directory for results.json and results.md")
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="how long `connected` holds its workers (default: 10, quick: 0.5)")
    args = parser.parse_args(argv)
    chosen = [b for b in args.only.split(",") if b] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    if args.minutes:
        os.environ["FEDBROKER_BENCH_MINUTES"] = str(args.minutes)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # children too: no GOAWAY chatter at shutdown
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    command = "python -m bench" + (" --quick" if args.quick else "") + (f" --only {args.only}" if args.only else "")
    info = machine()
    started = time.perf_counter()
    sections: list[Section] = []
    failed = []
    for name in chosen:
        print(f"[bench] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            section = RUNNERS[name](args.quick)
        except Exception as exc:
            traceback.print_exc()
            failed.append(name)
            section = Section(name, name, "failed", notes=[f"failed: {type(exc).__name__}: {exc}"])
            section.seconds = time.perf_counter() - t0
        sections.append(section)
        print(f"[bench] {name}: {len(section.rows)} rows in {section.seconds:.0f} s", flush=True)
    info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report = {
        "command": command,
        "mode": "quick" if args.quick else "full",
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": info,
    }
    os.makedirs(args.out, exist_ok=True)
    json_path, md_path = os.path.join(args.out, "results.json"), os.path.join(args.out, "results.md")
    write_results(json_path, md_path, report, sections)
    print(f"[bench] wrote {json_path} and {md_path} in {report['seconds']:.0f} s", flush=True)
    for section in sections:
        for goal in section.goals:
            mark = {True: "met", False: "NOT met", None: "-"}[goal.met]
            print(f"  {section.title}: {goal.name} = {goal.value} (target {goal.target}) {mark}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
