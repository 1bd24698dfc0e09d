#!/usr/bin/env bash
# Builds Jaeger's all-in-one binary (v2, OTLP receiver + query API + UI) from the Go module proxy into a cache dir
# outside the repository; prints its path. Minutes on first run (go.mod here pins the version; go.sum is written then).
#   STREAMFER_JAEGER_CACHE: where the binary goes (default ~/.cache/streamfer/jaeger)
set -euo pipefail
cd "$(dirname "$0")"
VERSION=v1.75.0
cache=${STREAMFER_JAEGER_CACHE:-$HOME/.cache/streamfer/jaeger}
bin="$cache/jaeger-$VERSION"
if [ ! -x "$bin" ]; then
  command -v go >/dev/null || { echo "jaeger: Go 1.24+ is needed to build Jaeger (https://go.dev/dl/)" >&2; exit 1; }
  mkdir -p "$cache"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  # The module lives in a scratch copy so the repository's go.mod stays a pin, not a lock file that changes per run.
  cp go.mod "$work/"
  [ -f go.sum ] && cp go.sum "$work/"
  echo "jaeger: building $VERSION into $bin (about 5 minutes on 2 cores the first time)" >&2
  (cd "$work" && go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@$VERSION" \
    && nice -n 10 go build -trimpath -o "$bin.tmp" github.com/jaegertracing/jaeger/cmd/jaeger)
  mv "$bin.tmp" "$bin"
fi
echo "$bin"
