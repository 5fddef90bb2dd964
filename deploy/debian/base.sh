#!/usr/bin/env bash
# The base image for hosts that reach Debian's package archive but no image registry: a minimal Debian root
# file system with Python, built from the archive (mmdebstrap, or debootstrap where only that is installed)
# and imported as a local image. Both Dockerfiles take it as BASE_IMAGE (docker-compose.debian.yml).
#
#   deploy/debian/base.sh [podman|docker]     # default: podman where installed, else docker
#
# Environment: LMPIPE_DEBIAN_IMAGE (default localhost/lmpipe-debian:bookworm), LMPIPE_DEBIAN_SUITE (bookworm:
# Python 3.11), LMPIPE_DEBIAN_MIRROR and LMPIPE_DEBIAN_SECURITY (default: the mirrors this host's apt uses,
# else deb.debian.org). Needs root (the root file system is built in a chroot).
set -euo pipefail

engine=${1:-$(command -v podman >/dev/null && echo podman || echo docker)}
image=${LMPIPE_DEBIAN_IMAGE:-localhost/lmpipe-debian:bookworm}
suite=${LMPIPE_DEBIAN_SUITE:-bookworm}
packages=python3,python3-venv

# The first URI of this host's apt sources that ends in /$1 (one-line or deb822 format).
host_mirror() {
    cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        grep -v '^[[:space:]]*#' | grep -oE "https?://[^[:space:]]+/$1/?([[:space:]]|$)" | head -n 1 | tr -d '[:space:]' || true
}
mirror=${LMPIPE_DEBIAN_MIRROR:-$(host_mirror debian)}
mirror=${mirror:-http://deb.debian.org/debian}
security=${LMPIPE_DEBIAN_SECURITY:-$(host_mirror debian-security)}
security=${security:-http://deb.debian.org/debian-security}

if [ "$(id -u)" != 0 ]; then
    echo "base.sh: needs root (it builds the root file system in a chroot)" >&2
    exit 1
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/lmpipe-debian.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "base.sh: building $image from $mirror ($suite, minbase + $packages)"
# Docs, man pages and translations are left out: nothing in a container reads them.
if command -v mmdebstrap >/dev/null; then
    # the tree is assembled in memory where there is room (it is ~300 MB); dpkg's fsyncs are pointless there
    work=/dev/shm
    [ -d "$work" ] && [ -w "$work" ] || work=$tmp
    TMPDIR=$work mmdebstrap --quiet --variant=minbase --include="$packages" \
        --dpkgopt=force-unsafe-io \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$suite" "$tmp/rootfs.tar" \
        "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security $suite-security main"
elif command -v debootstrap >/dev/null; then
    debootstrap --variant=minbase --include="$packages" "$suite" "$tmp/rootfs" "$mirror" >"$tmp/debootstrap.log" ||
        { tail -n 20 "$tmp/debootstrap.log" >&2; exit 1; }
    printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
        "$mirror" "$suite" "$mirror" "$suite" "$security" "$suite" >"$tmp/rootfs/etc/apt/sources.list"
    rm -rf "$tmp"/rootfs/var/cache/apt/archives/*.deb "$tmp"/rootfs/var/lib/apt/lists/* \
        "$tmp"/rootfs/usr/share/doc "$tmp"/rootfs/usr/share/man "$tmp"/rootfs/usr/share/locale
    tar -C "$tmp/rootfs" -cf "$tmp/rootfs.tar" .
else
    echo "base.sh: needs mmdebstrap or debootstrap (apt-get install mmdebstrap)" >&2
    exit 1
fi
if ! out=$("$engine" import --change 'CMD ["/bin/bash"]' \
    --change "LABEL org.opencontainers.image.description=Debian $suite minbase with $packages, from $mirror" \
    "$tmp/rootfs.tar" "$image" 2>&1); then
    echo "$out" >&2
    exit 1
fi
echo "base.sh: $image ready"
