#!/usr/bin/env bash
# Builds the CPU image's base locally, for machines that cannot pull from a container registry: a minimal
# Debian bookworm (python3 3.11 + python3-venv, Debian's packages) made with debootstrap and `docker import`ed
# as streamfer-base:bookworm. The root filesystem tarball is cached, so a rerun only re-imports it (seconds).
# CA certificates the host added (/usr/local/share/ca-certificates: a TLS-intercepting proxy's, say) are
# added to the image and pip is pointed at the system bundle, so `pip install` in the build trusts them.
#   deploy/container-check/base-image.sh [TAG]
set -euo pipefail
TAG=${1:-streamfer-base:bookworm}
CACHE=${STREAMFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/streamfer}
TARBALL=$CACHE/bookworm-python3.tar
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base-image: $TAG already present" >&2; exit 0
fi
if [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null || { echo "base-image: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
  mkdir -p "$CACHE"
  root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "base-image: debootstrap bookworm into $root (a few minutes, once)" >&2
  # passwd: groupadd/useradd for the image's user; ca-certificates: pip's TLS to the package index.
  debootstrap --variant=minbase --include=python3,python3-venv,passwd,ca-certificates \
    bookworm "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" --numeric-owner -cf "$TARBALL.tmp" .
  mv "$TARBALL.tmp" "$TARBALL"
  rm -rf "$root"
fi
docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' "$TARBALL" "$TAG-plain" >/dev/null
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir "$ctx/ca"
cp /usr/local/share/ca-certificates/*.crt "$ctx/ca/" 2>/dev/null || true
cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM $TAG-plain
COPY ca/ /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
DOCKERFILE
docker build -q --network host -t "$TAG" "$ctx" >/dev/null
echo "base-image: imported $TAG from $TARBALL" >&2
