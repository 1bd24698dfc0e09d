#!/usr/bin/env bash
# Builds a Kafka image with the official `apache/kafka` image's contract for machines that cannot pull it:
# Apache Kafka's jars from Maven Central (deploy/local-kafka/lib, as the local broker runs them) and Debian's
# JRE (openjdk-17-jre-headless, from Debian's apt) on the local base of base-image.sh. Prints the tag.
#   deploy/container-check/kafka-image.sh VENV [TAG]     (TAG default: streamfer/kafka:<kafka version>)
# Environment: KAFKA_BASE (default streamfer-base:bookworm, built by base-image.sh when missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv}
version=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' deploy/local-kafka/pom.xml)
TAG=${2:-streamfer/kafka:$version}
BASE=${KAFKA_BASE:-streamfer-base:bookworm}
[ "$BASE" != streamfer-base:bookworm ] || deploy/container-check/base-image.sh "$BASE"
lib=$("$VENV/bin/python" -c 'from worker.tools.local_broker import ensure_jars; print(ensure_jars())')
ctx=$(mktemp -d "${TMPDIR:-/tmp}/streamfer-kafka-image.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
cp -rL "$lib" "$ctx/lib"
cp deploy/container-check/kafka-image/Dockerfile deploy/container-check/kafka-image/run "$ctx/"
docker build --network host --build-arg BASE="$BASE" --build-arg KAFKA_VERSION="$version" -t "$TAG" "$ctx" \
  >"${TMPDIR:-/tmp}/streamfer-kafka-build.log" 2>&1 || { tail -30 "${TMPDIR:-/tmp}/streamfer-kafka-build.log" >&2; exit 1; }
echo "$TAG"
