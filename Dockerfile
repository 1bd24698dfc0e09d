# The streamfer worker image, in two variants from one file:
#
#   CPU (default):  docker build -t streamfer:cpu .
#   CUDA:           docker build --build-arg VARIANT=cuda -t streamfer:cuda .
#
# CPU runs on python:3.11-slim with torch's CPU-only wheels (a much smaller image than PyPI's default
# torch, which bundles CUDA libraries). CUDA runs on NVIDIA's CUDA 13 + cuDNN runtime image with Ubuntu
# 24.04's Python (3.12) and torch's cu130 wheels; it needs an NVIDIA driver >= 580 on the host and the
# NVIDIA container toolkit (`docker run --gpus all`, or `nvidia.com/gpu` on Kubernetes).
# Either variant takes plain PyPI torch instead with `--build-arg TORCH_INDEX_URL=https://pypi.org/simple`.
#
# No `# syntax=` line: BuildKit would pull that frontend image from Docker Hub, which fails where only package
# registries are reachable. The classic builder (no buildx) builds every stage, the CUDA base included: without
# registry access pass it a local base too (`./dev container-check` does; docs/deploy.md).
#
# The image runs `worker run` as an unprivileged user (uid 10001); settings come from WORKER_* env vars
# or `--config FILE`. Metrics, /healthz and /readyz are served on observability.metrics_port (9400).

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
# torch's cu130 wheels bring their own CUDA runtime and cuDNN: the much smaller
# nvidia/cuda:13.0.1-base-ubuntu24.04 works as well; the cudnn-runtime base also serves other CUDA code.
ARG CUDA_BASE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# -- the two bases: the same layout (python3 on PATH, able to make a venv) ----------------------------------
FROM ${CPU_BASE} AS base-cpu

FROM ${CUDA_BASE} AS base-cuda
# Ubuntu's current python3 (security updates) rather than a pinned build.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

# -- build: a self-contained venv in /opt/venv ---------------------------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS build
ARG VARIANT
# Empty: the variant's own index (CPU-only wheels, or cu130 wheels matching the CUDA 13 base).
ARG TORCH_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
# torch and torchvision first, from that index (torchvision is built for one torch and CUDA version, so the pair
# comes from one place); `pip install /src` then finds them already satisfied.
RUN case "$VARIANT" in \
      cpu) default=https://download.pytorch.org/whl/cpu ;; \
      cuda) default=https://download.pytorch.org/whl/cu130 ;; \
      *) echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && pip install --index-url "${TORCH_INDEX_URL:-$default}" "torch>=2.9,<3" "torchvision>=0.24"
COPY pyproject.toml README* /src/
COPY worker /src/worker
COPY schemas /src/schemas
RUN pip install /src
# The wheel installs the Avro schemas under <venv>/share/streamfer/schemas; the import fails the build if not.
RUN python -c "import worker.codec.schemas, worker.cli, torch, torchvision.io; print('torch', torch.__version__, 'torchvision', torchvision.__version__)" \
 && worker --help > /dev/null

# -- runtime: the venv on a clean base, no sources, no build caches -------------------------------------------
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/streamfer
# A regular (not --system) account: its uid is above the system range, and useradd --system warns about that.
RUN groupadd --gid 10001 streamfer \
 && useradd --uid 10001 --gid 10001 --home-dir /home/streamfer --create-home --shell /usr/sbin/nologin streamfer
COPY --from=build /opt/venv /opt/venv
WORKDIR /home/streamfer
# Numeric, so Kubernetes' runAsNonRoot can verify it without resolving a name.
USER 10001:10001
EXPOSE 9400
# Liveness of the process only (/readyz also needs partitions assigned, which depends on the group).
# Honours WORKER_OBSERVABILITY_METRICS_PORT; start-period covers the torch import and model load.
HEALTHCHECK --interval=15s --timeout=5s --start-period=90s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('WORKER_OBSERVABILITY_METRICS_PORT', '9400'), timeout=4)"]
ENTRYPOINT ["worker"]
CMD ["run"]
