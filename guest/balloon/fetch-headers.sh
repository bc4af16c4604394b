#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0
#
# Fetch and unpack the Debian 12 kernel headers that thinvm_balloon is
# built against, without installing anything on this machine.
#
# Usage: fetch-headers.sh [--refresh] [6.1|6.12]
#
#   6.1   linux-headers-amd64 from bookworm
#   6.12  linux-headers-amd64 from bookworm-backports (~bpo12)
#
# The meta package is followed to the real linux-headers-<kver>-amd64,
# linux-headers-<kver>-common and linux-kbuild-* packages.  Their .debs
# go to $cache/debs and are unpacked (dpkg-deb -x) into
# $cache/kernel/headers-<kver>.  The absolute paths Debian bakes into the
# tree (/usr/src/..., /lib/modules/<kver>/build) are rewritten to point
# inside the unpacked tree, so "make -C $KDIR M=..." works as is.
#
# The package resolution is remembered in $cache/kernel/resolved-<series>
# until the apt lists are refreshed (or --refresh is given), so a cached
# run does not call apt at all.
#
# The last line on stdout is the KDIR.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
apt_sh=$top/scripts/debian-apt.sh
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
debs=$cache/debs
kcache=$cache/kernel

refresh=0
series=6.12
while [ $# -gt 0 ]; do
	case "$1" in
	--refresh) refresh=1 ;;
	6.1|6.12) series=$1 ;;
	-h|--help)
		sed -n '3,22p' "$0" | sed 's/^# \{0,1\}//'
		exit 0
		;;
	*)
		echo "fetch-headers: unknown argument '$1' (want 6.1 or 6.12)" >&2
		exit 2
		;;
	esac
	shift
done

log() { echo "fetch-headers: $*" >&2; }

# Pick the linux-headers-amd64 version for the requested series from the
# madison listing: bookworm for 6.1, bookworm-backports (~bpo12) for 6.12.
meta_version() {
	"$apt_sh" madison linux-headers-amd64 |
		awk -F'|' -v s="$series" '
		{ gsub(/ /, "", $2); v = $2 }
		s == "6.1" && v ~ /^6\.1\./ && v !~ /bpo/ { print v }
		s == "6.12" && v ~ /^6\.12\./ && v ~ /~bpo12/ { print v }' |
		sort -V | tail -n 1
}

# Print the Depends: entries of PKG=VER, one "name [op ver]" per line,
# keeping only the first alternative of each.
depends_of() {
	"$apt_sh" show "$1" |
		awk '/^Depends:/ { sub(/^Depends: */, ""); print; exit }' |
		tr ',' '\n' | sed 's/|.*//; s/^ *//; s/ *$//'
}

# Choose a concrete version for a dependency "name (op ver)": an exact
# "=" pin is taken as is, otherwise the version equal to the meta
# package's if the archive has it, else the newest one listed.
pick_version() {
	local dep=$1 want=$2 name pin avail
	name=${dep%% *}
	pin=$(sed -n 's/.*(= *\([^)]*\)).*/\1/p' <<<"$dep")
	if [ -n "$pin" ]; then
		echo "$name=$pin"
		return
	fi
	avail=$("$apt_sh" madison "$name" | awk -F'|' '{ gsub(/ /, "", $2); print $2 }')
	if [ -z "$avail" ]; then
		log "no version of $name in the archive"
		exit 1
	fi
	if grep -qxF "$want" <<<"$avail"; then
		echo "$name=$want"
	else
		echo "$name=$(sort -V <<<"$avail" | tail -n 1)"
	fi
}

resolve() {
	local meta hdr dep pkgs=()
	meta=$(meta_version)
	if [ -z "$meta" ]; then
		log "no linux-headers-amd64 for $series; run '$apt_sh update'?"
		exit 1
	fi
	hdr=$(depends_of "linux-headers-amd64=$meta" |
		grep -E '^linux-headers-[^ ]+-amd64( |$)' | head -n 1)
	if [ -z "$hdr" ]; then
		log "linux-headers-amd64=$meta has no linux-headers-*-amd64 dependency"
		exit 1
	fi
	pkgs+=("$(pick_version "$hdr" "$meta")")
	while read -r dep; do
		case "$dep" in
		linux-headers-*-common*|linux-kbuild-*)
			pkgs+=("$(pick_version "$dep" "$meta")")
			;;
		esac
	done < <(depends_of "${pkgs[0]}")
	if [ "${#pkgs[@]}" -ne 3 ]; then
		log "expected headers, common and kbuild packages, got: ${pkgs[*]}"
		exit 1
	fi
	printf '%s\n' "${pkgs[@]}"
}

# The .deb file apt-get download writes for NAME=VERSION (epochs are
# encoded as %3a).
deb_glob() {
	local name=${1%%=*} ver=${1#*=}
	echo "${name}_${ver/:/%3a}_*.deb"
}

fetch_debs() {
	local p dl missing=()
	mkdir -p "$debs"
	for p in "$@"; do
		if ! compgen -G "$debs/$(deb_glob "$p")" >/dev/null; then
			missing+=("$p")
		fi
	done
	if [ "${#missing[@]}" -gt 0 ]; then
		log "downloading ${missing[*]}"
		# Download aside and move in, so that nobody sees half a file.
		dl=$(mktemp -d "$debs/.dl.XXXXXX")
		if ! (cd "$dl" && "$apt_sh" download "${missing[@]}"); then
			rm -rf "$dl"
			log "download failed"
			exit 1
		fi
		mv "$dl"/*.deb "$debs"/
		rm -rf "$dl"
	fi
}

# Rewrite the absolute references Debian bakes in so the tree is
# self-contained:
#  - usr/src/linux-headers-<kver>-amd64/Makefile includes
#    /usr/src/linux-headers-<kver>-common/Makefile;
#  - lib/modules/<kver>/{build,source} are absolute symlinks.
# The scripts/ and tools/ links into usr/lib/linux-kbuild-* are already
# relative and keep working.
fix_tree() {
	local root=$1 kver=$2 mk link target
	mk=$root/usr/src/linux-headers-$kver/Makefile
	# shellcheck disable=SC2016
	sed -i 's|^include /usr/src/|include $(dir $(realpath $(lastword $(MAKEFILE_LIST))))../|' "$mk"
	for link in "$root"/lib/modules/*/build "$root"/lib/modules/*/source; do
		[ -L "$link" ] || continue
		target=$(readlink "$link")
		case "$target" in
		/*) ln -sfn "../../..$target" "$link" ;;
		esac
	done
	if grep -q '/usr/src/' "$mk"; then
		log "could not rewrite $mk"
		exit 1
	fi
}

unpack() {
	local root=$1 kver=$2 p deb tmp
	shift 2
	tmp=$root.tmp
	rm -rf "$tmp"
	mkdir -p "$tmp"
	for p in "$@"; do
		# fetch_debs made sure there is one.
		deb=$(compgen -G "$debs/$(deb_glob "$p")" | head -n 1)
		dpkg-deb -x "$deb" "$tmp"
	done
	fix_tree "$tmp" "$kver"
	rm -rf "$root"
	mv "$tmp" "$root"
}

main() {
	local state=$kcache/resolved-$series stamp=$cache/apt/lists/.stamp
	local pkgs kver root kdir
	mkdir -p "$kcache"
	# One fetch at a time: parallel builds share the unpacked trees.
	exec 9>"$kcache/.lock"
	flock 9
	if [ "$refresh" = 1 ] || [ ! -s "$state" ] ||
		{ [ -e "$stamp" ] && [ "$stamp" -nt "$state" ]; }; then
		"$apt_sh" update || log "apt update failed, using the lists as they are"
		resolve >"$state.new"
		mv "$state.new" "$state"
	fi
	mapfile -t pkgs <"$state"
	# linux-headers-<kver>-amd64=<version>: <kver> is the uname -r.
	kver=${pkgs[0]%%=*}
	kver=${kver#linux-headers-}
	root=$kcache/headers-$kver
	kdir=$root/usr/src/linux-headers-$kver
	if [ ! -f "$root/.complete" ] ||
		[ "$(cat "$root/.complete")" != "${pkgs[*]}" ]; then
		fetch_debs "${pkgs[@]}"
		unpack "$root" "$kver" "${pkgs[@]}"
		echo "${pkgs[*]}" >"$root/.complete"
		log "unpacked ${pkgs[*]} into $root"
	fi
	echo "$kdir"
}

main
