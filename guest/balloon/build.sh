#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0
#
# Build thinvm_balloon.ko against Debian 12 kernel headers.
#
# Usage: build.sh [--no-werror] [6.1|6.12]
#
# Headers come from fetch-headers.sh.  The sources are copied to
# $cache/balloon/<kver>/build (Kbuild writes its objects next to the
# sources, and the work tree should stay clean) and the module ends up in
# $cache/balloon/<kver>/thinvm_balloon.ko.  Warnings are errors unless
# --no-werror is given.  The last line on stdout is the module's path.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}

series=6.12
werror=1
while [ $# -gt 0 ]; do
	case "$1" in
	--no-werror) werror=0 ;;
	6.1|6.12) series=$1 ;;
	-h|--help)
		sed -n '3,13p' "$0" | sed 's/^# \{0,1\}//'
		exit 0
		;;
	*)
		echo "build: unknown argument '$1' (want 6.1 or 6.12)" >&2
		exit 2
		;;
	esac
	shift
done

kdir=$("$here/fetch-headers.sh" "$series" | tail -n 1)
kver=$(basename "$kdir")
kver=${kver#linux-headers-}
out=$cache/balloon/$kver
build=$out/build

# Debian builds its kernels with a specific compiler (gcc-12 for both
# series) and the headers' Makefile uses it; fail early and clearly.
cc=$(sed -n 's/^CONFIG_CC_VERSION_TEXT="\([^ ]*\) .*/\1/p' "$kdir/.config")
if [ -n "$cc" ] && ! command -v "$cc" >/dev/null; then
	echo "build: compiler $cc not found: apt-get install ${cc##*-linux-gnu-}" >&2
	exit 1
fi

# Kbuild rebuilds by mtime, and sources copied from another checkout can
# be older than the objects built from the previous copy (a header change
# then left main.o built against the old one).  So the objects are kept
# only while the sources they were built from, by content, are the same.
mkdir -p "$build"
sources=("$here"/Makefile "$here"/*.c "$here"/*.h)
stamp=$build/.sources
hash=$(cat "${sources[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$hash" ]; then
	rm -rf "$build"
	mkdir -p "$build"
	cp "${sources[@]}" "$build"/
fi

args=(-C "$kdir" M="$build" -j2 modules)
# BTF for modules needs the vmlinux the headers were built with, and
# pahole.  Debian's 6.12 headers ship vmlinux; 6.1's do not, and Kbuild
# would only print a "Skipping BTF generation" notice, so switch module
# BTF off explicitly there (the module loads fine without it, it just
# cannot be inspected with BTF-based tools).
if [ ! -f "$kdir/vmlinux" ] || ! command -v pahole >/dev/null; then
	args+=(CONFIG_DEBUG_INFO_BTF_MODULES=)
fi
if [ "$werror" = 1 ]; then
	args+=(KCFLAGS=-Werror)
fi

log=$out/build.log
if ! make "${args[@]}" >"$log" 2>&1; then
	cat "$log" >&2
	echo "build: failed for $kver (log: $log)" >&2
	exit 1
fi
cat "$log" >&2
if grep -q 'warning:' "$log"; then
	echo "build: warnings for $kver (log: $log)" >&2
	[ "$werror" = 1 ] && exit 1
fi

echo "$hash" >"$stamp"
cp "$build/thinvm_balloon.ko" "$out/thinvm_balloon.ko"
echo "$out/thinvm_balloon.ko"
