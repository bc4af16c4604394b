#!/usr/bin/env bash
# The root filesystem of a packaged cluster host (docs/fleet.md, "Packaged
# hosts"): packaging/debian-root.sh's Debian 12 root plus what an operator
# installs on a libvirt host, from Debian only: libvirt-daemon-system and
# libvirt-clients 11.3 and qemu-system-x86 1:10.0.x from
# bookworm-backports (Debian's own QEMU: a stock host), and python3 (a
# Debian server has it; thinvm's control plane needs it, and the hosts
# have no network to fetch it), without Recommends.  thinvm's packages are NOT in it: a host installs them later
# with apt, from the local repository (packaging/build-debs.sh).
#
# The mirror is the one this machine's apt uses (scripts/debian-apt.sh
# mirror); the root's sources name bookworm and bookworm-backports there.
# Built once and cached as a tarball, unpacked next to it as the read-only
# lower layer of each host's overlay (thinvm.fleet.cluster).  Packages
# downloaded for it are kept in $THINVM_CACHE/host-root/archives (and the
# set-up's own backports downloads are used when they match), so a
# rebuild needs little network.  Rebuilt when this script, the mirror or
# the Debian root tarball changes.
#
# The root keeps /usr/sbin/policy-rc.d (exit 101), as Debian's container
# images do: without an init the cluster starts the daemons itself; a host
# booted by systemd (`cluster up --systemd`) removes it in its overlay.
#
# Usage: packaging/host-root.sh     (needs root; prints the unpacked root)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(dirname "$here")
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
dir=$cache/host-root
archives=$dir/archives
packages=(libvirt-daemon-system libvirt-clients qemu-system-x86 python3)

log() { printf '[host-root] %s\n' "$*" >&2; }
die() { printf '[host-root] error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (chroot, mount)"

base=$("$here/debian-root.sh")
uri=$("$top/scripts/debian-apt.sh" mirror)
hash=$({ echo "$uri"; basename "$base"; cat "$here/host-root.sh"; } | sha256sum | cut -c1-12)
tarball=$dir/host-$hash.tar
unpacked=$dir/host-$hash

mkdir -p "$archives"
exec 9>"$dir/.lock"
flock 9

unpack() {
	# The lower layer of the hosts' overlays: unpacked once, never written.
	if [ ! -f "$unpacked/.complete" ]; then
		rm -rf "$unpacked"
		mkdir -p "$unpacked.tmp"
		tar -xpf "$tarball" -C "$unpacked.tmp"
		touch "$unpacked.tmp/.complete"
		mv "$unpacked.tmp" "$unpacked"
	fi
	for old in "$dir"/host-*; do
		case $old in "$tarball" | "$unpacked") ;; *) rm -rf "$old" ;; esac
	done
	echo "$unpacked"
}

if [ -f "$tarball" ]; then
	unpack
	exit 0
fi

start=$SECONDS
work=$dir/build-$$
mounted=()
cleanup() {
	local m
	for m in "${mounted[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" || true; done
	rm -rf --one-file-system "$work"
}
trap cleanup EXIT
mkdir -p "$work"
log "extending $(basename "$base") with ${packages[*]} (bookworm-backports)"
tar -xpf "$base" -C "$work"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
cat >"$work/etc/apt/sources.list" <<SRC
deb $uri bookworm main
deb $uri bookworm-backports main
SRC
[ -f "$work$keyring" ] || die "no $keyring in the Debian root"
printf '#!/bin/sh\n# No init here: the cluster starts the daemons.\nexit 101\n' \
	>"$work/usr/sbin/policy-rc.d"
chmod 0755 "$work/usr/sbin/policy-rc.d"
# Debian's packages from the caches where they match; the rest from the mirror.
for d in "$archives" "$cache/debian-root/archives" "$cache/apt/archives"; do
	[ -d "$d" ] && find "$d" -maxdepth 1 -name '*.deb' -exec cp -p -t "$work/var/cache/apt/archives" {} +
done
cp /etc/resolv.conf "$work/etc/resolv.conf"
mount -t proc proc "$work/proc"
mounted+=("$work/proc")
in_root() {
	chroot "$work" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
		DEBIAN_FRONTEND=noninteractive "$@"
}
in_root apt-get -q update >&2
in_root apt-get -q -y -o Dpkg::Use-Pty=0 install --no-install-recommends \
	-t bookworm-backports "${packages[@]}" >&2
# shellcheck disable=SC2016 # dpkg-query's format, not the shell's
in_root dpkg-query -W -f='${Package} ${Version}\n' libvirt-daemon-system qemu-system-x86 >&2
find "$work/var/cache/apt/archives" -maxdepth 1 -name '*.deb' -exec cp -n -p -t "$archives" {} +
rm -f "$work"/var/cache/apt/archives/*.deb "$work/etc/resolv.conf"
umount "$work/proc"
mounted=()
tar -cpf "$tarball.tmp" -C "$work" .
mv "$tarball.tmp" "$tarball"
log "built in $((SECONDS - start)) s ($(du -h "$tarball" | cut -f1))"
unpack
