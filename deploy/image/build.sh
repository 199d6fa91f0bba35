#!/bin/sh
# Builds the OCI image localhost/ecd:latest with rootful podman, pulling nothing from a container
# registry (`make image` runs it; `make test-containers` runs it with --if-stale):
#   1. the base: a Debian rootfs from Debian's own packages (mmdebstrap --variant=apt, the host's
#      release, with python3.11), `podman import`ed as localhost/ecd-base:<suite>; built once;
#   2. a venv at /opt/ecd/venv built on the host with Debian's python3.11 (the same interpreter the
#      base has at the same path, so the venv works as is once copied in): torch ($TORCH_SPEC) and
#      ecd's dependencies, rebuilt only when those change; the package index is used from the host
#      because a build container may not reach it;
#   3. ecd itself, installed with --no-deps into a separate tree, its own small layer, so a source
#      change rebuilds in seconds and the 1 GB dependency layer comes from podman's cache.
# The image carries the digest of the sources it was built from (label io.ecd.source-digest);
# --if-stale rebuilds only when that differs from the working tree's (or the image is missing).
#
# Usage: deploy/image/build.sh [--if-stale | --digest]
# Environment: IMAGE (localhost/ecd:latest), TORCH_SPEC (torch==2.13.0; a CUDA build for GPU
# nodes, e.g. with PIP_EXTRA_INDEX_URL pointing at PyTorch's index), IMAGE_VENV (/opt/ecd/venv),
# IMAGE_PYTHON (/usr/bin/python3.11), IMAGE_SUITE (the host's VERSION_CODENAME), DEBIAN_MIRROR,
# ECD_UID (10001), IMAGE_REBASE=1 (rebuild the base), CONTAINERS_CONF (deploy/podman/containers.conf).
set -eu

REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
IMAGE=${IMAGE:-localhost/ecd:latest}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
IMAGE_VENV=${IMAGE_VENV:-/opt/ecd/venv}
IMAGE_PYTHON=${IMAGE_PYTHON:-/usr/bin/python3.11}
IMAGE_SUITE=${IMAGE_SUITE:-$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-bookworm}" || echo bookworm)}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ECD_UID=${ECD_UID:-10001}
BASE=localhost/ecd-base:$IMAGE_SUITE
export CONTAINERS_CONF="${CONTAINERS_CONF:-$REPO/deploy/podman/containers.conf}"

say() { printf 'make image: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# What the image is built from: ecd's sources, the build files and the torch choice. Untracked
# files count too (a new module not yet committed); README and tests do not.
source_digest() {
    { printf '%s\n' "$TORCH_SPEC" "$ECD_UID" "$IMAGE_SUITE"
      git ls-files -co --exclude-standard -- ecd pyproject.toml setup.py deploy/image deploy/podman \
          | grep -v -e '__pycache__' -e '\.so$' | LC_ALL=C sort | while read -r f; do
              [ -f "$f" ] && printf '%s  %s\n' "$(sha256sum < "$f" | cut -c1-64)" "$f"; done
    } | sha256sum | cut -c1-64
}

case "${1:-}" in
    --digest) source_digest; exit 0 ;;
    --if-stale|"") ;;
    *) die "unknown option $1 (usage: build.sh [--if-stale | --digest])" ;;
esac

[ "$(id -u)" = 0 ] || die "needs root: the image is built and run with rootful podman (sudo make image)"
for tool in podman mmdebstrap; do
    command -v $tool >/dev/null 2>&1 || die "$tool not found: apt-get install podman mmdebstrap runc uidmap"
done
[ -x "$IMAGE_PYTHON" ] || die "$IMAGE_PYTHON not found: the venv is built with Debian's python3.11 (apt-get install python3.11-venv python3.11-dev)"

DIGEST=$(source_digest)
if [ "${1:-}" = --if-stale ] && podman image exists "$IMAGE"; then
    have=$(podman image inspect --format '{{ index .Labels "io.ecd.source-digest" }}' "$IMAGE")
    if [ "$have" = "$DIGEST" ]; then
        say "$IMAGE is up to date (sources $DIGEST)"; exit 0
    fi
    say "$IMAGE was built from other sources: rebuilding"
fi

START=$(date +%s)

# ---- 1. the base rootfs ------------------------------------------------------------------------
if [ "${IMAGE_REBASE:-0}" = 1 ] || ! podman image exists "$BASE"; then
    say "building the $IMAGE_SUITE rootfs with mmdebstrap from $DEBIAN_MIRROR"
    tarball=$(mktemp /var/tmp/ecd-rootfs.XXXXXX.tar)
    trap 'rm -f "$tarball"' EXIT
    # The security and updates suites too: the host's python3.11 (whose venv is copied in) comes
    # from them, and the two interpreters should be the same build. Docs, man pages and locales
    # are left out (~60 MB).
    mmdebstrap --variant=apt --quiet --include=python3.11,libgomp1 \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        "$IMAGE_SUITE" "$tarball" \
        "deb $DEBIAN_MIRROR $IMAGE_SUITE main" \
        "deb $DEBIAN_MIRROR $IMAGE_SUITE-updates main" \
        "deb ${DEBIAN_MIRROR%/debian}/debian-security $IMAGE_SUITE-security main"
    podman import --quiet --change 'CMD ["/bin/bash"]' \
        --message "ecd base: Debian $IMAGE_SUITE (mmdebstrap --variant=apt) with python3.11" \
        "$tarball" "$BASE" >/dev/null
    rm -f "$tarball"; trap - EXIT
fi
host_py=$("$IMAGE_PYTHON" -c 'import platform; print(platform.python_version())')
image_py=$(podman run --rm --network=none --entrypoint /usr/bin/python3.11 "$BASE" \
           -c 'import platform; print(platform.python_version())') || die "the base $BASE cannot run python3.11"
[ "$host_py" = "$image_py" ] || say "warning: host python $host_py, image python $image_py (IMAGE_REBASE=1 rebuilds the base)"

# ---- 2. the dependency venv (torch + ecd's requirements), on the host --------------------------
deps=$("$IMAGE_PYTHON" -c 'import tomllib, sys; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
want=$(printf '%s\n%s\n%s\n' "$host_py" "$TORCH_SPEC" "$deps" | sha256sum | cut -c1-64)
if [ "$(cat "$IMAGE_VENV/.ecd-deps" 2>/dev/null)" != "$want" ]; then
    say "building the venv $IMAGE_VENV with $IMAGE_PYTHON ($TORCH_SPEC)"
    rm -rf "$IMAGE_VENV"
    "$IMAGE_PYTHON" -m venv "$IMAGE_VENV"
    "$IMAGE_VENV/bin/python" -m pip install --quiet --no-cache-dir "$TORCH_SPEC"
    # shellcheck disable=SC2086 # one requirement per line, none with spaces
    "$IMAGE_VENV/bin/python" -m pip install --quiet --no-cache-dir $deps
    echo "$want" > "$IMAGE_VENV/.ecd-deps"
fi

# ---- 3. the build context: the venv (hard links where possible), ecd, config -------------------
ctx=$(mktemp -d /var/tmp/ecd-image.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
cp -al "$IMAGE_VENV" "$ctx/venv" 2>/dev/null || cp -a "$IMAGE_VENV" "$ctx/venv"
src=$ctx/src
mkdir "$src"
tar -c --exclude=__pycache__ --exclude='*.so' pyproject.toml setup.py README.md ecd | tar -x -C "$src"
# --target: ecd alone (no deps), its own layer; the entry point's shebang is the venv's python.
"$IMAGE_VENV/bin/python" -m pip install --quiet --no-cache-dir --no-deps --target "$ctx/site" "$src"
mv "$ctx/site/bin" "$ctx/bin"
cp deploy/image/node.toml deploy/image/healthcheck.py "$ctx/"

say "podman build $IMAGE"
previous=$(podman image inspect --format '{{ .Id }}' "$IMAGE" 2>/dev/null || true)
podman build --quiet --pull=never --network=none --format docker \
    --build-arg BASE="$BASE" --build-arg TORCH_SPEC="$TORCH_SPEC" --build-arg ECD_UID="$ECD_UID" \
    --build-arg SOURCE_DIGEST="$DIGEST" --build-arg ECD_VERSION="$("$IMAGE_PYTHON" -c 'import re; print(re.search(r"__version__ = \"(.*)\"", open("ecd/__init__.py").read()).group(1))')" \
    -f deploy/image/Containerfile -t "$IMAGE" "$ctx" >/dev/null
# The image this build replaced keeps its layers until removed: drop it once nothing names it
# (its shared layers, the base and the venv's, stay with the new one).
if [ -n "$previous" ] && [ "$(podman image inspect --format '{{ .Id }}' "$IMAGE")" != "$previous" ] &&
   [ -z "$(podman image inspect --format '{{ join .RepoTags "" }}' "$previous" 2>/dev/null)" ]; then
    podman rmi "$previous" >/dev/null 2>&1 || true
fi
size=$(podman image inspect --format '{{ .Size }}' "$IMAGE")
say "built $IMAGE in $(( $(date +%s) - START )) s: $(( size / 1000000 )) MB (sources $DIGEST)"
