#!/usr/bin/env bash
# A local Debian base image for the CPU smoke device, where no container registry is reachable:
# debootstrap a minimal bookworm that has python3 (3.11) and its venv module, and import it.
#   containers/make-local-base.sh [image]      default localbase/debian:bookworm
set -euo pipefail
image=${1:-localbase/debian:bookworm}
if docker image inspect "$image" >/dev/null 2>&1; then echo "base image $image exists"; exit 0; fi
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" >/dev/null
tar -C "$rootfs" -c . | docker import - "$image" >/dev/null
echo "base image $image imported"
