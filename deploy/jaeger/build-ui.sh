#!/usr/bin/env bash
# Builds Jaeger's web UI, which a binary built from the Go module proxy lacks (its assets come from jaeger-ui's npm
# project, not from the Go module), into ~/.cache/streamfer/jaeger/ui-v1.75.0, where worker/tools/jaeger.py finds
# it (deploy/jaeger/config.yaml serves it). Only the docs' trace picture needs it (deploy/jaeger/screenshot.py);
# the tests read traces from the query API.
#   deploy/jaeger/build-ui.sh SRC    SRC: a checkout of jaeger-ui at tag v1.75.0 (the UI of Jaeger v1.75.0)
# Its packages come from the npm registry (package-lock.json: about 1500); it asks for Node 24, and builds on 20.
set -euo pipefail
src=${1:?usage: build-ui.sh JAEGER_UI_CHECKOUT}
out=${STREAMFER_JAEGER_CACHE:-$HOME/.cache/streamfer/jaeger}/ui-v1.75.0
[ -f "$out/index.html" ] && { echo "$out"; exit 0; }
command -v npm >/dev/null || { echo "jaeger-ui: npm is needed (apt-get install npm)" >&2; exit 1; }
cd "$src"
grep -q '"version": "1.75.0"' packages/jaeger-ui/package.json || echo "jaeger-ui: $src is not v1.75.0" >&2
nice -n 10 npm ci --engine-strict=false --ignore-scripts --no-audit --no-fund --loglevel=error >&2
nice -n 10 npm run build >&2
mkdir -p "$(dirname "$out")"
rm -rf "$out.tmp" && cp -r packages/jaeger-ui/build "$out.tmp" && mv "$out.tmp" "$out"
echo "$out"
