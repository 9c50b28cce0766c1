#!/usr/bin/env bash
# Builds the sidecar image from the repository with buildah (no daemon needed) or docker.
#
# usage: deploy/build_image.sh [TAG]        default tag: deadweight:<version in pyproject.toml>
# env:   DEADWEIGHT_PIP_CERT  CA bundle for pip where a proxy intercepts TLS; passed as a build
#                             secret, so it never lands in a layer
#        BUILDER              buildah or docker (default: buildah when installed)
#        BUILDAH_FLAGS        global buildah flags, e.g. "--root DIR --storage-driver vfs"
#        BUILDAH_PULL         base image pull policy for buildah (default: missing)
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)
tag=${1:-deadweight:$version}
secret=()
if [[ -n ${DEADWEIGHT_PIP_CERT:-} ]]; then
  secret=(--secret "id=pip_cert,src=$DEADWEIGHT_PIP_CERT")
fi
if [[ -z ${BUILDER:-} ]]; then
  if command -v buildah >/dev/null; then BUILDER=buildah; else BUILDER=docker; fi
fi

case $BUILDER in
  buildah)
    read -r -a flags <<<"${BUILDAH_FLAGS:-}"
    # docker format keeps the HEALTHCHECK, which the OCI image config has no field for.
    exec buildah "${flags[@]}" bud --isolation chroot --format docker \
      --pull="${BUILDAH_PULL:-missing}" "${secret[@]}" --tag "$tag" .
    ;;
  docker)
    DOCKER_BUILDKIT=1 exec docker build "${secret[@]}" --tag "$tag" .
    ;;
  *)
    echo "BUILDER must be buildah or docker, not $BUILDER" >&2
    exit 2
    ;;
esac
