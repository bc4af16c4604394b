#!/usr/bin/env bash
# Build Debian's QEMU 10.0 twice from one source: "stock" (Debian's own
# patches only) and "patched" (plus thinvm's series in qemu/series).
#
# Everything lives in $THINVM_CACHE (default ~/.cache/thinvm), outside the
# work tree, and every step is incremental: the source is fetched once, the
# patched tree is refreshed file by file (so only files a patch touches get
# a new mtime) and both builds share one ccache.
#
# A third flavour, "tsan", is the patched tree built with ThreadSanitizer
# for the migration qtests (qemu/run-qtests.sh --tsan); it is not part of
# "all", since nothing else needs it and it costs a full build of its own.
#
# Usage: qemu/build.sh [stock|patched|all|tsan]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(dirname "$here")
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
version=${THINVM_QEMU_VERSION:-1:10.0.13+ds-0+deb13u1}
upstream=${version#*:}
upstream=${upstream%-*}
srcdir=$cache/src
pristine=$cache/qemu/pristine-$upstream
venv=${THINVM_VENV:-$cache/venv}

export CCACHE_DIR=$cache/ccache
export CCACHE_BASEDIR=$cache/qemu
export CCACHE_NOHASHDIR=true
export CCACHE_MAXSIZE=4G

log() { printf '[qemu/build] %s\n' "$*" >&2; }
die() { printf '[qemu/build] error: %s\n' "$*" >&2; exit 1; }

fetch_source() {
	local dsc=$srcdir/qemu_${version#*:}.dsc
	[ -f "$dsc" ] && return
	log "fetching Debian source package qemu=$version"
	mkdir -p "$srcdir"
	"$top/scripts/debian-apt.sh" update
	(cd "$srcdir" && "$top/scripts/debian-apt.sh" source "qemu=$version")
	[ -f "$dsc" ] || die "source package qemu=$version not found"
}

# Debian's own patches come first: the +ds tarball strips bundled firmware
# and Python wheels and those patches teach the build to live without them.
unpack_pristine() {
	[ -f "$pristine/.thinvm-unpacked" ] && return
	log "unpacking $upstream with Debian's patches"
	rm -rf "$pristine" "$pristine.tmp"
	mkdir -p "$pristine.tmp"
	tar -xf "$srcdir/qemu_$upstream.orig.tar.xz" -C "$pristine.tmp" --strip-components=1
	tar -xf "$srcdir/qemu_${version#*:}.debian.tar.xz" -C "$pristine.tmp"
	local p
	while read -r p; do
		case "$p" in ''|'#'*) continue ;; esac
		patch -d "$pristine.tmp" -p1 -s -N -F0 <"$pristine.tmp/debian/patches/$p" ||
			die "Debian patch $p does not apply"
	done <"$pristine.tmp/debian/patches/series"
	touch "$pristine.tmp/.thinvm-unpacked"
	mv "$pristine.tmp" "$pristine"
}

series_files() {
	local p
	while read -r p; do
		case "$p" in ''|'#'*) continue ;; esac
		echo "$here/patches/$p"
	done <"$here/series"
}

# Hash of the series file and every patch it lists, in order: names the
# exact patched build. The stock build's hash is of the empty series.
patch_hash() {
	if [ "$1" = stock ]; then
		printf '' | sha256sum | cut -c1-12
		return
	fi
	{ cat "$here/series"; series_files | xargs -r cat; } | sha256sum | cut -c1-12
}

# Files a patch touches, from its diff headers.
touched_by() {
	sed -n -e 's|^--- a/||p' -e 's|^+++ b/||p' "$@" | sed 's/[[:space:]].*//' | sort -u
}

# The stock tree is a copy of the pristine one, so that each flavour builds
# in a build/ directory inside its own tree: the compiler then sees the
# same relative paths (../hw/..., -I../include) in both builds, and with
# CCACHE_NOHASHDIR every file the series does not touch is compiled once
# for both (a build directory beside the tree named the tree in every
# path, and the second build missed the cache for all ~1800 files).
stock_tree() {
	local tree=$1
	[ "$(cat "$tree/.thinvm-copy-of" 2>/dev/null)" = "$pristine" ] && return
	log "creating the stock source tree"
	rm -rf "$tree"
	cp -a "$pristine" "$tree"
	printf '%s\n' "$pristine" >"$tree/.thinvm-copy-of"
}

# The patched tree is the pristine tree plus the series.  Only files that
# the previous or the current series touches can differ from pristine, so
# only those are rebuilt, in a small stage, and copied over when their
# content changed: everything else keeps its mtime and make skips it.
prepare_tree() {
	local flavour=$1 tree=$cache/qemu/$1-src
	[ "$flavour" = tsan ] && flavour=patched tree=$cache/qemu/patched-src
	if [ "$flavour" = stock ]; then
		stock_tree "$tree"
		echo "$tree"
		return
	fi
	local want stamp=$tree/.thinvm-series
	want=$(patch_hash patched)
	if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$want" ]; then
		echo "$tree"
		return
	fi
	if [ ! -f "$stamp" ]; then
		log "creating the patched source tree"
		rm -rf "$tree"
		cp -a "$pristine" "$tree"
		printf 'none\n' >"$stamp"
	fi
	local stage=$cache/qemu/patched-stage p f
	rm -rf "$stage"
	mkdir -p "$stage"
	local files
	files=$( { tail -n +2 "$stamp"; series_files | xargs -r cat | touched_by -; } | sort -u)
	for f in $files; do
		if [ -f "$pristine/$f" ]; then
			mkdir -p "$stage/$(dirname "$f")"
			cp -p "$pristine/$f" "$stage/$f"
		fi
	done
	for p in $(series_files); do
		[ -f "$p" ] || die "patch listed in qemu/series is missing: $p"
		patch -d "$stage" -p1 -s -N -F0 --no-backup-if-mismatch <"$p" >&2 ||
			die "patch $(basename "$p") does not apply"
	done
	for f in $files; do
		if [ ! -f "$stage/$f" ]; then
			rm -f "$tree/$f"
		elif ! cmp -s "$stage/$f" "$tree/$f"; then
			mkdir -p "$tree/$(dirname "$f")"
			cp "$stage/$f" "$tree/$f"
		fi
	done
	rm -rf "$stage"
	{ echo "$want"; series_files | xargs -r cat | touched_by -; } >"$stamp"
	echo "$tree"
}

# The build directory remembers the arguments it was configured with
# (.thinvm-configure, one a line): a directory configured with others is
# configured again in place (QEMU's configure starts meson afresh there and
# ninja then rebuilds what the new configuration changed, mostly from
# ccache), so a warm cache picks up a change to the list below.
configure_build() {
	local flavour=$1 tree=$2 build=$2/build
	[ "$flavour" = tsan ] && build=$tree/build-tsan
	# Build directories of the layout before stock_tree() above.
	rm -rf "$cache/qemu/$flavour-build"
	# configure pins the compiler, which defeats meson's own ccache
	# detection: name ccache explicitly so the second flavour and any
	# rebuild from scratch hit the cache.
	local cc=gcc extra=()
	command -v ccache >/dev/null && cc="ccache gcc"
	# TSan needs the fiber interface of gcc's libtsan for coroutines.
	[ "$flavour" = tsan ] && extra=(--enable-tsan)
	# zstd: multifd-compression=zstd (bench migrate-compress); required,
	# so a host without libzstd-dev fails here rather than build without.
	local args=(
		--cc="$cc" "${extra[@]}"
		--python="$venv/bin/python3"
		--target-list=x86_64-softmmu
		--enable-kvm --enable-tcg --enable-zstd
		--disable-docs --disable-install-blobs --disable-download
		--disable-user --disable-tools --disable-guest-agent
		--disable-gtk --disable-sdl --disable-vnc --disable-opengl
		--disable-spice --disable-curses --disable-xen
		--disable-werror
		--with-pkgversion="thinvm-$flavour"
		--firmwarepath=/usr/share/qemu:/usr/share/seabios:/usr/lib/ipxe/qemu
	)
	local stamp=$build/.thinvm-configure want
	want=$(printf '%s\n' "$tree/configure" "${args[@]}")
	if [ -f "$build/build.ninja" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
		echo "$build"
		return
	fi
	if [ -f "$build/build.ninja" ]; then
		log "configuring $flavour build again: its configure arguments changed"
	else
		log "configuring $flavour build"
		rm -rf "$build"
		mkdir -p "$build"
	fi
	rm -f "$stamp"
	(cd "$build" && "$tree/configure" "${args[@]}") >&2 ||
		die "configure failed for $flavour (see above)"
	printf '%s\n' "$want" >"$stamp"
	echo "$build"
}

write_stamp() {
	local flavour=$1 build=$2 out=$cache/qemu/$1
	mkdir -p "$out"
	# An unchanged binary keeps its mtime: the test suite's kept boots
	# (thinvm.testing.keptboot) are keyed by it.
	cmp -s "$build/qemu-system-x86_64" "$out/qemu-system-x86_64" ||
		install -m 0755 "$build/qemu-system-x86_64" "$out/qemu-system-x86_64"
	cat >"$out/build.json" <<JSON
{
  "flavour": "$flavour",
  "debian_version": "$version",
  "patch_hash": "$(patch_hash "$flavour")",
  "patches": [$(if [ "$flavour" = patched ]; then series_files | xargs -r -n1 basename | sed 's/.*/"&"/' | paste -sd, -; fi)],
  "binary": "$out/qemu-system-x86_64"
}
JSON
}

# qtests run the binary from the build tree, which looks for firmware in
# its qemu-bundle: point that at Debian's seabios, qemu and ipxe files.
link_firmware() {
	local data=$1/qemu-bundle/usr/local/share/qemu f
	mkdir -p "$data"
	for f in /usr/share/seabios/* /usr/share/qemu/* /usr/lib/ipxe/qemu/*; do
		[ -e "$f" ] && ln -sfn "$f" "$data/$(basename "$f")"
	done
}

build_one() {
	local flavour=$1 tree build targets=qemu-system-x86_64
	tree=$(prepare_tree "$flavour")
	build=$(configure_build "$flavour" "$tree")
	# The patched build also carries our qtests (qemu/run-qtests.sh).
	case $flavour in
	patched) targets="$targets tests/qtest/qos-test tests/qtest/virtio-balloon-test tests/qtest/migration-test" ;;
	tsan) targets="$targets tests/qtest/migration-test" ;;
	esac
	log "building $flavour ($(nproc) jobs)"
	ninja -C "$build" -j"$(nproc)" $targets >&2 ||
		die "$flavour build failed"
	link_firmware "$build"
	write_stamp "$flavour" "$build"
	log "$flavour: $cache/qemu/$flavour/qemu-system-x86_64 (patch hash $(patch_hash "$flavour"))"
}

[ -x "$venv/bin/python3" ] || die "no build venv at $venv: run 'make setup' first"
fetch_source
unpack_pristine
case "${1:-all}" in
stock|patched) build_one "$1" ;;
all) build_one stock; build_one patched ;;
tsan) build_one tsan ;;
*) die "unknown build '$1' (stock, patched, all or tsan)" ;;
esac
