#!/usr/bin/env bash
# `./dev container-check`, in two parts. (1) Kafka in testcontainers: builds a Kafka image with the official
# `apache/kafka` image's contract from the Maven jars (kafka-image.sh) and runs the test kit's integration tests
# with the broker started and stopped by testcontainers (tests/container/test_kafka_container.py asserts it).
# (2) The worker image: builds the CPU image and runs it for real (tests/container/test_image.py) against a
# local Kafka broker on loopback. Every container uses `--network host`; a Docker engine this script starts
# itself runs with `--bridge=none --iptables=false` on a private socket (so other tools on the machine do
# not mistake it for theirs) and is stopped at the end.
#   deploy/container-check/run.sh VENV [--kafka-only] [PYTEST_ARGS...]   (PYTEST_ARGS go to part 2)
# Environment: DOCKER_HOST (an engine to use instead), STREAMFER_KAFKA_IMAGE (an image for part 1 instead of
# building one), TORCH_INDEX_URL (default: PyPI, see docs/deploy.md), CPU_BASE (default: a local Debian
# bookworm from deploy/container-check/base-image.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv}
shift || true
kafka_only=""
pytest_args=()
for arg in "$@"; do
  if [ "$arg" = --kafka-only ]; then kafka_only=1; else pytest_args+=("$arg"); fi
done
IMAGE=${STREAMFER_CHECK_IMAGE:-streamfer:check}
t0=$(date +%s)
say() { echo "container-check [$(( $(date +%s) - t0 ))s]: $*" >&2; }

command -v docker >/dev/null || { echo "container-check: needs the docker client and engine (apt-get install docker.io)" >&2; exit 1; }
started_engine=""
broker_dir=""
cleanup() {
  [ -z "$broker_dir" ] || { "$VENV/bin/python" -m worker broker destroy --dir "$broker_dir" >/dev/null 2>&1 || true; rm -rf "$broker_dir"; }
  [ -z "$started_engine" ] || { kill "$started_engine" 2>/dev/null; wait "$started_engine" 2>/dev/null || true; }
}
trap cleanup EXIT
if [ -z "${DOCKER_HOST:-}" ] && ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || { echo "container-check: no Docker engine answers and dockerd is missing (apt-get install docker.io)" >&2; exit 1; }
  run=/run/streamfer-docker
  mkdir -p "$run"
  export DOCKER_HOST=unix://$run/docker.sock
  if ! docker info >/dev/null 2>&1; then
    say "starting dockerd on $DOCKER_HOST"
    dockerd -H "$DOCKER_HOST" --pidfile "$run/docker.pid" --bridge=none --iptables=false --ip6tables=false \
      >"$run/dockerd.log" 2>&1 &
    started_engine=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || { tail -20 "$run/dockerd.log" >&2; exit 1; }
  fi
fi
export DOCKER_HOST=${DOCKER_HOST:-}
[ -n "$DOCKER_HOST" ] || unset DOCKER_HOST

KAFKA_IMAGE=${STREAMFER_KAFKA_IMAGE:-}
if [ -z "$KAFKA_IMAGE" ]; then
  say "building the Kafka image (apache/kafka's contract, Maven jars, Debian's JRE)"
  KAFKA_IMAGE=$(deploy/container-check/kafka-image.sh "$VENV")
  say "built $KAFKA_IMAGE: $(docker image inspect -f '{{.Size}}' "$KAFKA_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
fi
say "the test kit's integration tests, Kafka by testcontainers ($KAFKA_IMAGE)"
# No KAFKA_BOOTSTRAP_SERVERS, so the kit asks the engine; Ryuk (testcontainers' reaper) is off: its image
# cannot be pulled here, and the kit stops its container itself.
env -u KAFKA_BOOTSTRAP_SERVERS STREAMFER_KAFKA_IMAGE="$KAFKA_IMAGE" STREAMFER_EXPECT_BROKER=testcontainers \
  TESTCONTAINERS_RYUK_DISABLED=true "$VENV/bin/python" -m pytest -p no:cacheprovider -q \
  tests/container/test_kafka_container.py tests/integration/test_testing_kit.py tests/integration/test_testing_doc.py
left=$(docker ps -aq --filter label=org.testcontainers=true --filter ancestor="$KAFKA_IMAGE")
[ -z "$left" ] || { echo "container-check: testcontainers left containers behind: $left" >&2; exit 1; }
say "testcontainers started and removed its Kafka container"
if [ -n "$kafka_only" ]; then say "done (--kafka-only)"; exit 0; fi

if [ -z "${CPU_BASE:-}" ]; then
  deploy/container-check/base-image.sh streamfer-base:bookworm
  CPU_BASE=streamfer-base:bookworm
fi
say "building $IMAGE (CPU_BASE=$CPU_BASE)"
# The classic builder (no buildx here) builds every stage, the CUDA base too: give it the CPU base, so
# nothing is pulled from a registry. With BuildKit the unused stage is skipped.
docker build --network host --build-arg CPU_BASE="$CPU_BASE" --build-arg CUDA_BASE="$CPU_BASE" \
  --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://pypi.org/simple}" -t "$IMAGE" . >"${TMPDIR:-/tmp}/streamfer-build.log" 2>&1 \
  || { tail -40 "${TMPDIR:-/tmp}/streamfer-build.log" >&2; exit 1; }
say "built $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}')"
if [ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]; then
  broker_dir=$(mktemp -d "${TMPDIR:-/tmp}/streamfer-check-kafka.XXXXXX")
  KAFKA_BOOTSTRAP_SERVERS=$("$VENV/bin/python" -m worker broker start --dir "$broker_dir")
  export KAFKA_BOOTSTRAP_SERVERS
  say "local broker on $KAFKA_BOOTSTRAP_SERVERS"
fi
STREAMFER_CONTAINER_IMAGE=$IMAGE "$VENV/bin/python" -m pytest -p no:cacheprovider tests/container/test_image.py "${pytest_args[@]}"
say "done"
