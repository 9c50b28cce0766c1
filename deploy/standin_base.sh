#!/usr/bin/env bash
# Builds a local stand-in for the image's base (python:3.11-slim) from Debian packages and
# commits it under that name, for machines that reach Debian and PyPI but no container
# registry. The committed image is cached in its own buildah storage, so re-runs take a second.
#
# usage: deploy/standin_base.sh [IMAGE_NAME]
# env:   DEADWEIGHT_BASE_CACHE  cache dir (default /var/tmp/deadweight-base); buildah storage
#                               lives under it (vfs driver), apart from the machine's own store.
#        DEBIAN_MIRROR          default: the first Debian mirror apt is configured with.
set -euo pipefail

name=${1:-docker.io/library/python:3.11-slim}
cache=${DEADWEIGHT_BASE_CACHE:-/var/tmp/deadweight-base}
suite=bookworm # Debian 12 ships Python 3.11, the version of the real base.
bh=(buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver vfs)

if "${bh[@]}" inspect --type image "$name" >/dev/null 2>&1; then
  echo "stand-in base $name: cached"
  exit 0
fi

mirror=${DEBIAN_MIRROR:-}
if [[ -z $mirror ]]; then
  mirror=$(grep -h -m1 -E '^(URIs:|deb) ' /etc/apt/sources.list.d/debian.sources \
    /etc/apt/sources.list 2>/dev/null | head -n1 | awk '{print $2}' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
fi

ctr=$("${bh[@]}" from scratch)
trap '"${bh[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
rootfs=$("${bh[@]}" mount "$ctr")
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  "$suite" "$rootfs" "$mirror"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/dev/*
"${bh[@]}" umount "$ctr"
"${bh[@]}" config --env LANG=C.UTF-8 \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --cmd python3 "$ctr"
"${bh[@]}" commit "$ctr" "$name"
echo "stand-in base $name: built from $mirror"
