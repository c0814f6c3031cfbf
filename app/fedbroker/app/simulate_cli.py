"""The `fedbroker simulate` verb's arguments (registered by fedbroker.app.cli)."""

from __future__ import annotations

import argparse
import logging


def add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker simulate job.yaml` under the main parser's subcommands."""
    from fedbroker.app.simulate import SimulateOptions
    from fedbroker.app.tracking import add_track_arguments

    d = SimulateOptions(job="")
    p = sub.add_parser("simulate", help="run your job file on this machine before submitting it",
                       description="Run a job file on this machine with N simulated workers (the demo's engine): "
                                   "a progress bar per round, a results table, results.json and accuracy.png.")
    p.add_argument("job", help="the job file (YAML or JSON), as `fedbroker submit` takes it")
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--partition", choices=["iid", "dirichlet", "classes"], default=d.partition,
                   help="how the data is split between the workers")
    p.add_argument("--alpha", type=float, default=d.alpha, help="Dirichlet α of --partition dirichlet")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--dataset", choices=["digits", "breast_cancer", "wine", "iris"],
                      help="a bundled set (default: the job's evaluation set)")
    data.add_argument("--worker-config", help="a worker config file whose `worker` section names your data "
                                              "(dataset csv | npz | parquet | idx | images | nifti | dicom, data.*, idx_dir) and DP policy")
    p.add_argument("--dp", action=argparse.BooleanOptionalAction, default=d.dp,
                   help="without --worker-config: train with Opacus DP (the demo's policy)")
    p.add_argument("--noise-multiplier", type=float, default=d.noise_multiplier)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    p.add_argument("--epsilon-budget", type=float, default=d.epsilon_budget)
    p.add_argument("--broker", default="", help="amqp://... runs every component as a process (default: in-process)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--seed", type=int, default=d.seed)
    add_track_arguments(p, what="the simulated job")
    p.set_defaults(run=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    """Run the simulation the flags describe (fedbroker.app.simulate)."""
    from fedbroker.app.logs import setup_logging
    from fedbroker.app.simulate import SimulateOptions, run_simulation

    setup_logging(logging.WARNING)
    run_simulation(SimulateOptions(
        job=args.job, workers=args.workers, partition=args.partition, alpha=args.alpha, dataset=args.dataset or "",
        worker_config=args.worker_config or "", dp=args.dp, noise_multiplier=args.noise_multiplier,
        max_grad_norm=args.max_grad_norm, epsilon_budget=args.epsilon_budget, broker=args.broker, out=args.out,
        seed=args.seed, track=args.track, experiment=args.experiment))
    return 0
