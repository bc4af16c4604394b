#!/usr/bin/env bash
# Build every prefix of the patch series: the series must be bisectable,
# each patch building on its own (issue 49).
#
#   qemu/check-prefixes.sh [--from N] [--qtests]
#
# Works on a git worktree of the dev tree (qemu/dev-tree.sh init) at
# $THINVM_CACHE/qemu/prefix-tree with a build directory of its own,
# configured once as qemu/build.sh configures the patched build; each
# prefix rebuilds what its patch changed (ccache shared with the other
# builds).  Builds QEMU and the qtest binaries the series touches at
# every prefix; with --qtests also runs, at every prefix, each of
# qemu/run-qtests.sh's tests that the prefix already has (each must pass
# with the patches it came with, not only on the whole series).
# Prints one line per prefix; exit status 0 only if all built (and passed).
set -euo pipefail

cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
venv=${THINVM_VENV:-$cache/venv}
dev=$cache/qemu/dev
tree=$cache/qemu/prefix-tree
build=$tree/build
from=1
qtests=0
here=$(cd "$(dirname "$0")" && pwd)

log() { printf '[qemu/prefixes] %s\n' "$*" >&2; }
die() { printf '[qemu/prefixes] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
	case $1 in
	--from) from=$2; shift 2 ;;
	--qtests) qtests=1; shift ;;
	*) die "usage: qemu/check-prefixes.sh [--from N] [--qtests]" ;;
	esac
done
[ -d "$dev/.git" ] || die "no dev tree at $dev: run qemu/dev-tree.sh init"

export CCACHE_DIR=$cache/ccache CCACHE_BASEDIR=$cache/qemu CCACHE_NOHASHDIR=true

mapfile -t commits < <(git -C "$dev" rev-list --reverse base..HEAD)
[ ${#commits[@]} -gt 0 ] || die "no commits above 'base' in $dev"
if [ ! -d "$tree" ]; then
	git -C "$dev" worktree add -q --detach "$tree" base
fi
# The subprojects Debian's source ships unpacked are not in git (ignored):
# configure --disable-download needs them, and no patch touches them.
for d in "$dev"/subprojects/*/; do
	[ -d "$tree/subprojects/$(basename "$d")" ] || cp -a "$d" "$tree/subprojects/"
done
git -C "$tree" checkout -q --detach "${commits[$((from - 1))]}"

# The arguments of qemu/build.sh's configure_build() for the patched build.
if [ ! -f "$build/build.ninja" ]; then
	log "configuring $build"
	mkdir -p "$build"
	cc=gcc
	command -v ccache >/dev/null && cc="ccache gcc"
	(cd "$build" && "$tree/configure" --cc="$cc" --python="$venv/bin/python3" \
		--target-list=x86_64-softmmu --enable-kvm --enable-tcg --enable-zstd \
		--disable-docs --disable-install-blobs --disable-download \
		--disable-user --disable-tools --disable-guest-agent \
		--disable-gtk --disable-sdl --disable-vnc --disable-opengl \
		--disable-spice --disable-curses --disable-xen \
		--disable-werror --with-pkgversion=thinvm-prefix \
		--firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu) >&2 ||
		die "configure failed"
fi

# The qtests run QEMU from the build tree, which looks for firmware in its
# qemu-bundle: Debian's source leaves the blobs out (qemu/build.sh's
# link_firmware() does the same for the patched build).
data=$build/qemu-bundle/usr/local/share/qemu
mkdir -p "$data"
for f in /usr/share/seabios/* /usr/share/qemu/* /usr/lib/ipxe/qemu/*; do
	[ -e "$f" ] && ln -sfn "$f" "$data/$(basename "$f")"
done

failed=0
for ((i = from; i <= ${#commits[@]}; i++)); do
	c=${commits[$((i - 1))]}
	subject=$(git -C "$dev" log -1 --format=%s "$c")
	git -C "$tree" checkout -q --detach "$c"
	targets=qemu-system-x86_64
	for t in qos-test virtio-balloon-test migration-test; do
		[ -f "$tree/tests/qtest/$t.c" ] && targets+=" tests/qtest/$t"
	done
	start=$(date +%s)
	if ! ninja -C "$build" -j"$(nproc)" $targets >"$build/prefix-$i.log" 2>&1; then
		printf 'FAIL  %02d %s (build, %s)\n' "$i" "$subject" "$build/prefix-$i.log"
		failed=1
		continue
	fi
	if [ $qtests = 1 ] && ! "$here/run-qtests.sh" --build "$build" --available \
		>"$build/prefix-$i.qtests" 2>&1; then
		printf 'FAIL  %02d %s (qtests, %s)\n' "$i" "$subject" "$build/prefix-$i.qtests"
		failed=1
		continue
	fi
	printf 'ok    %02d %s (%ss%s)\n' "$i" "$subject" "$(($(date +%s) - start))" \
		"$([ $qtests = 1 ] && echo ", $(grep -c '^ok' "$build/prefix-$i.qtests") qtests")"
done
exit $failed
