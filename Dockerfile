# One image for every fedbroker process (coordinator, aggregator, worker): `fedbroker <command>`.
#   CPU (default):  docker build -t ghcr.io/fedbroker/fedbroker:0.1.0 .
#   CUDA workers:   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     -t ghcr.io/fedbroker/fedbroker:0.1.0-cuda .
# The CUDA wheels of torch carry their own CUDA runtime; the node supplies only the driver (NVIDIA device plugin).
# Static scan (checkov, tests/ops/test_checkov.py); the two skips are explained in deploy/README.md:
# checkov:skip=CKV_DOCKER_2:Kubernetes ignores HEALTHCHECK; the manifests give every pod its probes
# checkov:skip=CKV_DOCKER_7:FROM is the build argument PYTHON_IMAGE, a pinned tag that checkov does not resolve
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/fedbroker
ENV PATH=/opt/fedbroker/bin:$PATH
# torch first and pinned: from the CPU (or CUDA) index, so nothing later pulls another build
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY requirements.txt /src/requirements.txt
# runtime dependencies only (requirements.txt): test, lint and code-generation tools are in
# requirements-dev.txt, MLflow in requirements-tracking.txt, neither ever installed here (pyproject reads both)
RUN pip install -r /src/requirements.txt
COPY pyproject.toml README.md MANIFEST.in requirements-dev.txt requirements-tracking.txt /src/
COPY fedbroker /src/fedbroker
COPY proto /src/proto
COPY coordinator /src/coordinator
COPY worker /src/worker
COPY aggregators /src/aggregators
COPY app /src/app
# installed as fedbroker.k8s_base: the base `fedbroker provision` copies into a server kit
COPY deploy/k8s/base /src/deploy/k8s/base
# the model catalogue (`fedbroker models list|show`) ships in the package as fedbroker.model_catalogue
COPY examples/models /src/examples/models
RUN pip install --no-deps /src

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="fedbroker" \
      org.opencontainers.image.description="Federated learning over RabbitMQ and gRPC with per-data-owner DP"
ENV PATH=/opt/fedbroker/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=build /opt/fedbroker /opt/fedbroker
# the uid/gid the Kubernetes manifests run as (runAsUser 10001); no shell login, no home on the read-only root
RUN groupadd --gid 10001 fedbroker \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin fedbroker \
    && mkdir -p /var/lib/fedbroker && chown 10001:10001 /var/lib/fedbroker
USER 10001:10001
WORKDIR /var/lib/fedbroker
EXPOSE 50051 50052 9400
ENTRYPOINT ["fedbroker"]
CMD ["--help"]
