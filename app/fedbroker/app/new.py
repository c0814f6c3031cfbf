"""`fedbroker new [sync|async|alignment|own-data] [--out FILE]`: a job file to start from, every setting commented.

The templates are the examples' jobs (examples/: the image CNN, one-shot PFNM fusion, the tabular CSV with
DWFed) written out with a comment on each setting; they live here, not read from examples/, so an installed
`fedbroker` has them too. tests/app/test_new_job.py holds each to the example it comes from and passes each
through the coordinator's own submission parser.
"""

from __future__ import annotations

import argparse
import os
import sys

from fedbroker.errors import ConfigError

_MODEL_CNN = """\
model:                           # layers from an allow-list, never code (README "Jobs")
  input_shape: [1, 8, 8]         # one sample as the workers' data holds it: 1 channel of 8x8 pixels
  layers:                        # in order; each layer's inputs must match the previous layer's outputs
    - {type: Conv2d, in_channels: 1, out_channels: 8, kernel_size: 3, padding: 1}
    - {type: GroupNorm, num_groups: 2, num_channels: 8}   # DP (Opacus) needs GroupNorm, not BatchNorm
    - {type: ReLU}
    - {type: MaxPool2d, kernel_size: 2}
    - {type: Flatten}
    - {type: Linear, in_features: 128, out_features: 10}  # 8 channels x 4 x 4 in, one score per class out
"""

_TRAINING_REST = """\
  local_epochs: 1                # passes over its data each time it trains (more epochs, more ε spent)
  batch_size: 32                 # samples per step (with DP: the expected batch of Poisson sampling)
  optimizer: sgd                 # sgd | adam
  lr: 0.1                        # the local optimiser's learning rate
  momentum: 0.0                  # sgd only
  proximal_mu: 0.0               # > 0: FedProx's proximal term, keeps local models near the global one
"""

_EVALUATION = """\
evaluation:                      # the coordinator scores every global model on a held-out set of its own
  dataset: digits                # digits | breast_cancer | wine | iris; "" (or no section): no scores
  test_fraction: 0.2             # the part of that set held out for scoring
  split_seed: 0                  # which samples are held out
"""

SYNC = """\
# A synchronous job (`fedbroker new sync`, the image CNN of examples/image-cnn-idx on the bundled digits):
# every round, each selected worker trains the global model on its own data under its owner's DP policy,
# and the aggregation service averages the updates into the next global model.
# Try it on this machine first: `fedbroker simulate job.yaml`; then `fedbroker submit job.yaml --follow`.
name: digits-cnn                 # your name for it (letters, digits, - and _): the job id starts with it
category: digits                 # the workers that train it: those whose worker.categories list it
seed: 0                          # the initial weights' seed: the same seed, the same start
""" + _MODEL_CNN + """\
training:                        # what each worker does with its own data in each round
  rounds: 5                      # global rounds
""" + _TRAINING_REST + """\
aggregation:                     # how the updates become the next global model (docs/algorithms.md)
  alignment: none                # none | feddna | pfnm | nafi: match neurons before averaging (+ alignment_params)
  weighting: fedavg              # fedavg (by samples) | uniform | dwfed (by label mix) (+ weighting_params)
  selection: all                 # all | random | ga: which workers train each round (+ selection_params)
schedule:                        # who trains when
  mode: sync                     # sync: rounds with a barrier; async: FedBuff versions (`fedbroker new async`)
  clients_per_round: 0           # workers asked per round; 0 = every active worker of the category
  quorum: 0                      # uploads that close a round early; 0 = every selected worker
  min_clients: 1                 # the fewest uploads a round may close with at its deadline
  min_workers: 1                 # active workers needed before round 1
  round_timeout_s: 600           # a round's deadline in seconds: later uploads are refused
  wait_for_workers_s: 120        # how long the job waits for min_workers before it fails
""" + _EVALUATION

ASYNC = """\
# An asynchronous job (`fedbroker new async`, FedBuff): no round barrier. Each worker holds one task at a time and
# gets the next the moment its update is accepted; the aggregation service publishes a new global version every
# buffer_size updates, each discounted by how many versions it lags (README "Asynchronous mode").
# Try it on this machine first: `fedbroker simulate job.yaml --workers 4`; `fedbroker status` shows its versions.
name: digits-cnn-async           # your name for it (letters, digits, - and _): the job id starts with it
category: digits                 # the workers that train it: those whose worker.categories list it
seed: 0                          # the initial weights' seed: the same seed, the same start
""" + _MODEL_CNN + """\
training:                        # what each worker does with its own data in each task
  rounds: 20                     # in async mode: the number of global versions
""" + _TRAINING_REST + """\
aggregation:                     # async mode takes no alignment and no selection: each update comes alone
  alignment: none                # must be none in async mode
  weighting: fedavg              # fedavg | uniform | dwfed, times the staleness discount
  selection: all                 # must be all in async mode
schedule:                        # who trains when
  mode: async                    # FedBuff: versions instead of rounds
  buffer_size: 2                 # accepted updates per new version; 0 = every active worker when the job starts
  max_staleness: 10              # an update more versions behind than this is refused (reason `stale`)
  staleness: polynomial          # constant | polynomial: (1+τ)^-a | hinge
  staleness_params: {a: 0.5}     # polynomial's a (hinge: a and b)
  server_lr: 1.0                 # η_g: how far each version moves towards the buffer's mean update
  time_budget_s: 0               # also end the job after this much wall-clock time; 0 = no limit
  min_workers: 1                 # active workers needed before the first task
  round_timeout_s: 600           # a task's deadline in seconds: past it the worker drops it and gets a new one
  wait_for_workers_s: 120        # how long the job waits for min_workers (or for a worker that can afford a task)
""" + _EVALUATION

ALIGNMENT = """\
# One-shot fusion (`fedbroker new alignment`, examples/one-shot-fusion/job-pfnm.yaml): every site trains its own
# MLP for many epochs, and the aggregation service fuses the models once, matching hidden neurons across sites
# (PFNM; `nafi` is the faster alternative) instead of averaging them position by position. The global hidden
# layer may grow: the next model spec comes back with the weights.
# Try it on this machine first: `fedbroker simulate job.yaml --workers 3 --partition dirichlet --no-dp`.
name: digits-one-shot-pfnm       # your name for it (letters, digits, - and _): the job id starts with it
category: digits                 # the workers that train it: those whose worker.categories list it
seed: 0                          # the initial weights' seed: the same seed, the same start
model:                           # alignment needs Linear layers; it refuses GroupNorm
  input_shape: [1, 8, 8]         # one sample as the workers' data holds it
  layers:                        # in order; each layer's inputs must match the previous layer's outputs
    - {type: Flatten}
    - {type: Linear, in_features: 64, out_features: 100}  # the hidden layer PFNM matches across sites
    - {type: ReLU}
    - {type: Linear, in_features: 100, out_features: 10}
training:                        # what each worker does with its own data
  rounds: 1                      # one-shot: a single fusion
  local_epochs: 10               # long local training, each site's model complete on its own
  batch_size: 32                 # samples per step (with DP: the expected batch of Poisson sampling)
  optimizer: sgd                 # sgd | adam
  lr: 0.1                        # the local optimiser's learning rate
aggregation:                     # how the sites' models become one (docs/algorithms.md)
  alignment: pfnm                # feddna | pfnm | nafi; none averages position by position
  alignment_params: {sigma2: 1.0, sigma0_2: 1.0, gamma0: 1.0, iterations: 5, max_global_width: 300}  # PFNM's priors; the widest the global layer may grow
  weighting: fedavg              # fedavg (by samples) | uniform | dwfed
  selection: all                 # alignment fuses every site's model
schedule:                        # who trains when
  min_workers: 3                 # active workers needed before the round: the sites to fuse
  round_timeout_s: 300           # the round's deadline in seconds: later uploads are refused
  wait_for_workers_s: 60         # how long the job waits for min_workers before it fails
evaluation: {dataset: digits}    # the coordinator's held-out digits score the fused model; omit for none
"""

OWN_DATA = """\
# A job on the sites' own data (`fedbroker new own-data`, examples/tabular-csv-dwfed): each hospital exports a CSV
# and its worker reads it; only model updates leave the site. Each site's worker config names its file, e.g.
#   worker:
#     categories: [breast-cancer]            # the category below
#     dataset: csv                           # csv | npz | parquet | idx (with idx_dir) | images | nifti | dicom
#                                            # (image folders and volumes: docs/data.md, examples/xray-folders)
#     data: {path: data/patients.csv, label_column: diagnosis, classes: [malignant, benign], standardize: true,
#            feature_columns: [...]}         # the model's inputs, in the model's order
# Try it on this machine first: `fedbroker simulate job.yaml --worker-config worker.yaml --workers 3`.
name: breast-cancer-dwfed        # your name for it (letters, digits, - and _): the job id starts with it
category: breast-cancer          # the workers that train it: those whose worker.categories list it
seed: 0                          # the initial weights' seed: the same seed, the same start
model:                           # layers from an allow-list, never code (README "Jobs")
  input_shape: [10]              # one sample: the 10 columns each site's worker.data.feature_columns lists
  layers:                        # in order; each layer's inputs must match the previous layer's outputs
    - {type: Linear, in_features: 10, out_features: 32}
    - {type: ReLU}
    - {type: Linear, in_features: 32, out_features: 2}   # two classes: the sites' data.classes, in that order
training:                        # what each worker does with its own data in each round
  rounds: 5                      # global rounds
  local_epochs: 1                # passes over its data per round (more epochs, more ε spent per round)
  batch_size: 16                 # samples per step (with DP: the expected batch of Poisson sampling)
  optimizer: sgd                 # sgd | adam
  lr: 0.1                        # the local optimiser's learning rate
aggregation:                     # how the updates become the next global model (docs/algorithms.md)
  alignment: none                # none | feddna | pfnm | nafi
  weighting: dwfed               # DWFed: sites whose label mix is closer to the population's count more
  selection: all                 # all | random | ga
schedule:                        # who trains when
  min_workers: 3                 # active workers needed before round 1: the hospitals
  min_clients: 2                 # the fewest uploads a round may close with at its deadline
  round_timeout_s: 300           # a round's deadline in seconds: later uploads are refused
  wait_for_workers_s: 60         # how long the job waits for min_workers before it fails
data:                            # the sites' raw measurements, in their own units (docs/evaluation.md)
  standardize: federated         # before round 1 the sites agree on one mean and std per feature (noised sums)
  bounds:                        # per feature, clipping the shared sums only: known from the measurement, not the data
    [[5, 30], [5, 40], [40, 200], [100, 2600], [0.05, 0.17], [0, 0.35], [0, 0.45], [0, 0.21], [0.1, 0.31], [0.04, 0.1]]
evaluation: {every: 1}           # no set at the coordinator: each site scores every round on its own held-out rows
"""

TEMPLATES = {"sync": SYNC, "async": ASYNC, "alignment": ALIGNMENT, "own-data": OWN_DATA}


def cmd_new(args: argparse.Namespace) -> int:
    """Write the template to --out (never over a file, unless --force) or to stdout."""
    text = TEMPLATES[args.kind]
    if not args.out:
        sys.stdout.write(text)
        return 0
    if os.path.isdir(args.out):
        raise ConfigError("--out", f"{args.out} is a folder; name the job file to write (e.g. {args.out}/job.yaml)")
    mode = "w" if args.force else "x"
    try:
        with open(args.out, mode, encoding="utf-8") as fh:
            fh.write(text)
    except FileExistsError:
        raise ConfigError("--out", f"{args.out} exists; choose another name or add --force") from None
    print(f"wrote {args.out} ({args.kind} job): edit it, try it with `fedbroker simulate {args.out}`, then "
          f"`fedbroker submit {args.out}`", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker new` under the main parser's subcommands."""
    p = sub.add_parser("new", help="write a job file to start from (sync, async, alignment, own-data), commented",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", nargs="?", default="sync", choices=sorted(TEMPLATES),
                   help="which job (default: sync)")
    p.add_argument("--out", help="the file to write (default: print to stdout)")
    p.add_argument("--force", action="store_true", help="write over --out if it exists")
    p.set_defaults(run=cmd_new)
