#!/usr/bin/env bash
# `./dev tracing-check`: builds Jaeger v2 from the Go module proxy (deploy/jaeger/build.sh; minutes the first time,
# then cached in ~/.cache/streamfer/jaeger) and runs tests/tracing against it: frames with traceparent through a real
# broker (KAFKA_BOOTSTRAP_SERVERS, else the test kit's own) and a real worker, the trace read back from Jaeger.
#   deploy/jaeger/check.sh VENV [PYTEST_ARGS...]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv}
shift || true
STREAMFER_JAEGER=$(deploy/jaeger/build.sh)
export STREAMFER_JAEGER
echo "tracing-check: Jaeger $STREAMFER_JAEGER" >&2
exec "$VENV/bin/python" -m pytest -m tracing tests/tracing "$@"
