#!/usr/bin/env bash
# Build thinvm-agent and thinvm-mem (static) into the cache and print the
# directory they are in; the image builders share it.
#
# The directory is named after the sources: make goes by timestamps, and
# every checkout shares the cache, so a checkout whose edit is older than
# another checkout's build (a CI clone built after it) would otherwise be
# handed that build's binaries.  Two image builds may run at once: one
# lock per directory.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
obj=$cache/agent-build/$(cat "$here"/*.[ch] "$here"/Makefile | sha256sum | cut -c1-16)
mkdir -p "$obj"
flock "$obj/.lock" make -s -C "$here" O="$obj" >&2
echo "$obj"
