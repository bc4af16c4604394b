#!/usr/bin/env bash
# A fresh Debian 12 root filesystem for package tests: mmdebstrap's "apt"
# variant (the essential packages and apt, nothing else) of bookworm main,
# from the mirror this machine's apt uses (scripts/debian-apt.sh mirror:
# never a host name written here).  Built once and cached as a tarball;
# tests unpack a copy and install into that.
#
# apt's package lists stay in the tarball, and every .deb mmdebstrap or a
# test downloads is kept in $THINVM_CACHE/debian-root/archives, so a test
# that installs from the cache needs no network.  The tarball is rebuilt
# when this script changes, the mirror changes, or it is 30 days old
# (older lists name versions the mirror may no longer have).
#
# Usage: packaging/debian-root.sh       (needs root; prints the tarball)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(dirname "$here")
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
dir=$cache/debian-root
archives=$dir/archives

log() { printf '[debian-root] %s\n' "$*" >&2; }
die() { printf '[debian-root] error: %s\n' "$*" >&2; exit 1; }

command -v mmdebstrap >/dev/null || die "mmdebstrap not found: run scripts/setup.sh"
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap --mode=root)"

uri=$("$top/scripts/debian-apt.sh" mirror)
hash=$({ echo "$uri"; cat "$here/debian-root.sh"; } | sha256sum | cut -c1-12)
tarball=$dir/bookworm-$hash.tar

# mmdebstrap has apt's hooks written through "cat >&N" by /bin/sh, and
# dash takes only single-digit descriptors there: descriptors inherited
# from the caller (a CI runner's, a lock's) push N past 9, and apt then
# fails with "Bad fd number".  Keep only stdin, stdout and stderr.
for fd in /proc/$$/fd/*; do
	fd=${fd##*/}
	if [ "$fd" -gt 2 ] && [ "$fd" -lt 100 ]; then
		eval "exec $fd>&-"
	fi
done

mkdir -p "$archives"
exec 9>"$dir/.lock"
flock 9
if [ -f "$tarball" ] && [ -n "$(find "$tarball" -mtime -30)" ]; then
	echo "$tarball"
	exit 0
fi

start=$SECONDS
log "mmdebstrap: Debian 12 (bookworm, variant apt) into $tarball"
# shellcheck disable=SC2016 # "$1" is the hook's argument, for mmdebstrap
mmdebstrap --mode=root --variant=apt --format=tar \
	--skip=cleanup/apt/lists \
	--setup-hook='mkdir -p "$1"/var/cache/apt/archives/' \
	--setup-hook="sync-in $archives /var/cache/apt/archives/" \
	--customize-hook="sync-out /var/cache/apt/archives $archives" \
	--customize-hook='rm -f "$1"/var/cache/apt/archives/*.deb' \
	bookworm "$tarball.tmp" "deb $uri bookworm main" >&2 9>&-
mv "$tarball.tmp" "$tarball"
for old in "$dir"/bookworm-*.tar; do
	[ "$old" = "$tarball" ] || rm -f "$old"
done
log "built in $((SECONDS - start)) s ($(du -h "$tarball" | cut -f1))"
echo "$tarball"
