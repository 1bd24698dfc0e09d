#!/usr/bin/env bash
# Builds Jaeger's all-in-one binary (v2: OTLP receiver, query API, UI) from the Go module proxy into a cache dir
# outside the repository, and prints its path. go.mod/go.sum here pin it: they were made by
#   go get -tool github.com/jaegertracing/jaeger/cmd/jaeger@v1.75.0
# About 5-10 minutes on 2 cores the first time (121 MB); then the cached binary is reused.
#   STREAMFER_JAEGER_CACHE: where the binary goes (default ~/.cache/streamfer/jaeger)
set -euo pipefail
cd "$(dirname "$0")"
VERSION=v1.75.0
cache=${STREAMFER_JAEGER_CACHE:-$HOME/.cache/streamfer/jaeger}
bin="$cache/jaeger-$VERSION"
if [ ! -x "$bin" ]; then
  command -v go >/dev/null || { echo "jaeger: Go 1.24+ is needed to build Jaeger (https://go.dev/dl/)" >&2; exit 1; }
  grep -q "github.com/jaegertracing/jaeger $VERSION" go.mod || { echo "jaeger: go.mod does not pin $VERSION" >&2; exit 1; }
  mkdir -p "$cache"
  echo "jaeger: building $VERSION into $bin (minutes the first time)" >&2
  nice -n 10 go build -trimpath -o "$bin.tmp" github.com/jaegertracing/jaeger/cmd/jaeger
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
