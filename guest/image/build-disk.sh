#!/usr/bin/env bash
# Build the thinvm Debian 12 disk image: a qcow2 root filesystem made
# only from Debian packages (mmdebstrap), with systemd, a serial console,
# no network, and thinvm's guest packages installed the way a user installs
# them (packaging/build-debs.sh): the agent as the thinvm-guest-agent
# package, whose postinst enables its systemd unit, and our balloon driver
# as the thinvm-balloon-dkms package, built by DKMS inside the image
# against the image's own kernel, blacklisting the in-tree virtio_balloon.
#
# The image boots by direct kernel boot (the kernel and initramfs are
# copied out next to the disk): no boot loader to install or wait for.
#
# Usage: guest/image/build-disk.sh [--kernel 6.1|6.12]
#
#   6.1   linux-image-amd64 from bookworm
#   6.12  linux-image-amd64 from bookworm-backports
#
# Cached under $THINVM_CACHE/disk/<kernel>-<inputs>; an image whose
# inputs (these scripts, the agent and driver sources and packaging, the
# kernel package version) did not change is not rebuilt, and the image built
# before the newest is kept as well (prune_older).  Downloaded .debs are
# kept in $THINVM_CACHE/debs/disk, so a rebuild does not download again.
# The last line on stdout is the image directory: disk.qcow2, vmlinuz,
# initrd.img, image.json.  Progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
apt=$top/scripts/debian-apt.sh
agent_src=$top/guest/agent
balloon_src=$top/guest/balloon
disk_src=$here/disk

# The kernel command line the image boots with.  no_timer_check: the
# kernel's IO-APIC timer check counts ticks in a short delay loop, and a
# vCPU on a loaded host sees none and panics ("IO-APIC + timer doesn't
# work!"): seen in our CI under TCG, as OpenStack's and CirrOS' CIs did.
cmdline="root=/dev/vda rw console=ttyS0 no_timer_check"
# Virtual size of the root filesystem; qcow2 stores only what is used.
disk_size=2G
# Packages beyond the "apt" variant (essential + apt).  dkms brings
# gcc and make; the headers are what DKMS builds against.
packages=(systemd-sysv udev kmod initramfs-tools procps dkms)

log() { printf '[guest/image/disk] %s\n' "$*" >&2; }
die() { printf '[guest/image/disk] error: %s\n' "$*" >&2; exit 1; }

usage() {
	echo "usage: guest/image/build-disk.sh [--kernel 6.1|6.12]" >&2
	exit 2
}

kernel=6.1
while [ $# -gt 0 ] && [ "$1" != --customize ]; do
	case $1 in
	--kernel) [ $# -ge 2 ] || usage; kernel=$2; shift 2 ;;
	-h|--help) usage ;;
	*) log "unknown argument '$1'"; usage ;;
	esac
done
case $kernel in
6.1) suite=bookworm ;;
6.12) suite=bookworm-backports ;;
*) die "--kernel $kernel: want 6.1 or 6.12" ;;
esac

command -v mmdebstrap >/dev/null || die "mmdebstrap not found: run scripts/setup.sh"
command -v qemu-img >/dev/null || die "qemu-img not found: run scripts/setup.sh"
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap --mode=root, mke2fs -d)"

tmp=$(mktemp -d "${TMPDIR:-/var/tmp}/thinvm-disk.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The Debian mirror this machine uses, as debian-apt.sh configured it:
# never a host name written here.
mirror() {
	awk '$1 == "deb" && $NF == "main" && $(NF-1) == "bookworm" { print $(NF-2); exit }' \
		"$cache/apt/etc/sources.list"
}

# The linux-image-amd64 version of $suite: part of the inputs, so a new
# Debian kernel makes a new image.  The answer only changes when the apt
# lists do, so it is remembered until they are refreshed: a query costs
# ~0.8 s of CPU, and the test suite asks for an up-to-date image some 30
# times.
kernel_meta_version() {
	local memo=$cache/disk/.meta-$kernel lists=$cache/apt/lists
	if [ ! -s "$memo" ] || [ -n "$(find "$lists" -newer "$memo" -print -quit)" ]; then
		mkdir -p "$cache/disk"
		query_meta_version >"$memo.$$"
		mv "$memo.$$" "$memo"
	fi
	cat "$memo"
}

query_meta_version() {
	"$apt" madison linux-image-amd64 |
		awk -F'|' -v s="$kernel" '
		{ gsub(/ /, "", $2); v = $2 }
		s == "6.1" && v ~ /^6\.1\./ && v !~ /bpo/ { print v }
		s == "6.12" && v ~ /^6\.12\./ && v ~ /~bpo12/ { print v }' |
		sort -V | tail -n 1
}

inputs_hash() {
	{
		echo "$kernel $suite $meta ${packages[*]} $disk_size"
		sha256sum "$here/build-disk.sh" "$disk_src"/* \
			"$agent_src"/*.[ch] "$agent_src"/Makefile "$agent_src"/build-cached.sh \
			"$balloon_src"/*.c "$balloon_src"/*.h "$balloon_src"/Makefile \
			"$balloon_src"/dkms.conf "$balloon_src"/thinvm-balloon.conf \
			"$top"/packaging/build-debs.sh "$top"/packaging/copyright \
			"$top"/packaging/thinvm-guest-agent/* \
			"$top"/packaging/thinvm-balloon-dkms/* | awk '{ print $1 }'
	} | sha256sum | cut -c1-16
}

build_agent() {
	local obj
	obj=$("$agent_src/build-cached.sh")
	cp "$obj/thinvm-mem" "$tmp/"
}

# Everything the customize hooks copy into the image, in one directory.
stage_files() {
	local s=$tmp/stage
	mkdir -p "$s"
	cp "$tmp/thinvm-mem" "$disk_src"/* "$s/"
	local deb
	for deb in $("$top/packaging/build-debs.sh" thinvm-guest-agent thinvm-balloon-dkms); do
		cp "$deb" "$s/"
	done
}

bootstrap() {
	local uri debs=$cache/debs/disk root=$tmp/root
	uri=$(mirror)
	[ -n "$uri" ] || die "no bookworm mirror in $cache/apt/etc/sources.list"
	mkdir -p "$debs"
	local include=("${packages[@]}")
	if [ "$suite" = bookworm-backports ]; then
		include+=(linux-image-amd64/bookworm-backports linux-headers-amd64/bookworm-backports)
	else
		include+=(linux-image-amd64 linux-headers-amd64)
	fi
	log "mmdebstrap: Debian 12 with kernel $kernel ($meta)"
	# The hooks: keep downloaded .debs in the cache (sync-in/out), set up
	# the initramfs before the kernel is installed, then install our
	# files and the DKMS package (which builds the driver), and trim
	# what a test guest never reads.
	# shellcheck disable=SC2016 # "$1" is the hook's argument, for mmdebstrap
	mmdebstrap --mode=root --variant=apt --format=directory \
		--include="$(IFS=,; echo "${include[*]}")" \
		--dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/doc/*' \
		--dpkgopt='path-include=/usr/share/doc/*/copyright' \
		--dpkgopt='path-exclude=/usr/share/locale/*' \
		--dpkgopt='path-exclude=/usr/share/info/*' \
		--skip=essential/unlink \
		--setup-hook='mkdir -p "$1"/var/cache/apt/archives/' \
		--setup-hook="sync-in $debs /var/cache/apt/archives/" \
		--setup-hook='mkdir -p "$1"/etc/initramfs-tools/conf.d "$1"/etc/initramfs-tools/hooks' \
		--setup-hook='echo MODULES=list >"$1"/etc/initramfs-tools/conf.d/thinvm' \
		--setup-hook="install -m 0755 $tmp/stage/initramfs-hook \"\$1\"/etc/initramfs-tools/hooks/thinvm" \
		--setup-hook="install -D -m 0644 $tmp/stage/thinvm-lab-modprobe.conf \"\$1\"/etc/modprobe.d/thinvm-lab.conf" \
		--customize-hook="sync-out /var/cache/apt/archives $debs" \
		--customize-hook='rm -f "$1"/var/cache/apt/archives/*.deb' \
		--customize-hook="$here/build-disk.sh --customize $tmp/stage \"\$1\"" \
		bookworm "$root" \
		"deb $uri bookworm main" "deb $uri bookworm-backports main" >&2
}

# What a headless test guest under TCG does not start: each unit is a
# fork and exec or a module load that costs the host seconds of CPU while
# the test that booted the guest runs.  The serial console keeps its login.
# (The module blacklist goes in before the kernel, for the initramfs.)
boot_less() {
	local s=$1 r=$2
	install -D -m 0644 "$s/thinvm-lab-journald.conf" \
		"$r/etc/systemd/journald.conf.d/thinvm-lab.conf"
	# getty-static starts gettys on tty2-6 when there is no logind.
	chroot "$r" systemctl mask --quiet getty-static.service getty@tty1.service \
		modprobe@dm_mod.service modprobe@efi_pstore.service \
		modprobe@fuse.service modprobe@loop.service \
		sys-kernel-debug.mount sys-kernel-tracing.mount \
		sys-fs-fuse-connections.mount \
		apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
		e2scrub_all.timer fstrim.timer
}

# Runs as a mmdebstrap customize hook: $1 = staged files, $2 = the root.
customize() {
	local s=$1 r=$2
	# The test tools stay outside the packages.
	install -m 0755 "$s/thinvm-guest-info" "$r/usr/local/sbin/thinvm-guest-info"
	install -m 0755 "$s/thinvm-mem" "$r/usr/local/bin/thinvm-mem"
	install -m 0644 "$s/thinvm-boot-done.service" "$r/etc/systemd/system/"
	chroot "$r" systemctl enable thinvm-boot-done.service
	boot_less "$s" "$r"
	# Installed as a user would: dpkg runs the postinsts, which enable
	# thinvm-agent.service and have DKMS build the driver.
	cp "$s"/thinvm-guest-agent_*.deb "$s"/thinvm-balloon-dkms_*_all.deb "$r/tmp/"
	chroot "$r" sh -c 'dpkg -i /tmp/thinvm-guest-agent_*.deb /tmp/thinvm-balloon-dkms_*_all.deb'
	rm -f "$r"/tmp/thinvm-guest-agent_*.deb "$r"/tmp/thinvm-balloon-dkms_*_all.deb
	[ -L "$r/etc/systemd/system/multi-user.target.wants/thinvm-agent.service" ] ||
		die "thinvm-guest-agent did not enable thinvm-agent.service"
	ls "$r"/lib/modules/*/updates/dkms/thinvm_balloon.ko* >/dev/null ||
		die "DKMS did not install thinvm_balloon.ko"
	echo "/dev/vda / ext4 rw,discard,errors=remount-ro 0 1" >"$r/etc/fstab"
	echo thinvm-guest >"$r/etc/hostname"
	# A test guest: root logs in on the serial console without password.
	chroot "$r" passwd -d root >/dev/null
	# Compilers and headers stay (DKMS needs them for kernel updates);
	# what goes is what only a full system reads.
	rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/*.bin \
		"$r"/var/lib/dkms/*/*/build "$r"/var/log/*.log
}

make_disk() {
	local root=$tmp/root kver
	kver=$(find "$root/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -V | tail -n 1)
	[ -f "$root/boot/vmlinuz-$kver" ] || die "no vmlinuz-$kver in the image"
	[ -f "$root/boot/initrd.img-$kver" ] || die "no initrd.img-$kver in the image"
	cp "$root/boot/vmlinuz-$kver" "$tmp/vmlinuz"
	cp "$root/boot/initrd.img-$kver" "$tmp/initrd.img"
	chmod 0644 "$tmp/vmlinuz" "$tmp/initrd.img"
	log "making the ext4 filesystem ($(du -sh "$root" | cut -f1) of files)"
	mke2fs -q -t ext4 -L thinvm-root -d "$root" "$tmp/root.raw" "$disk_size"
	log "converting to compressed qcow2"
	qemu-img convert -c -O qcow2 "$tmp/root.raw" "$tmp/disk.qcow2"
	rm -f "$tmp/root.raw"
	kver_out=$kver
}

write_json() {
	printf '{"kernel":"%s","kernel_version":"%s","kernel_package_version":"%s","suite":"%s","cmdline":"%s","driver_package":"%s","inputs":"%s"}\n' \
		"$kernel" "$kver_out" "$meta" "$suite" "$cmdline" \
		"$(basename "$tmp"/stage/thinvm-balloon-dkms_*_all.deb)" "$hash" >"$tmp/image.json"
}

# Keep the new image and the one built before it; older ones are stale.
# Two callers whose apt lists differ by a Debian kernel upload (a checkout
# refreshed them today, another not yet) then each find their own image,
# instead of rebuilding it in turn (~3 min each) for as long as both run.
prune_older() {
	local keep=$1 d kept=
	for d in $(ls -dt "$cache/disk/$kernel"-* | grep -v -e '\.tmp$'); do
		[ "$d" = "$keep" ] && continue
		if [ -z "$kept" ]; then
			kept=$d
		else
			rm -rf "$d"
		fi
	done
}

main() {
	local start=$SECONDS d
	"$apt" update || log "warning: apt update failed, using the lists as they are"
	meta=$(kernel_meta_version)
	[ -n "$meta" ] || die "no linux-image-amd64 $kernel in $suite"
	hash=$(inputs_hash)
	out=$cache/disk/$kernel-$hash
	if [ -f "$out/image.json" ]; then
		log "up to date: $out"
		echo "$out"
		return
	fi
	mkdir -p "$cache/disk"
	exec 9>"$cache/disk/.lock-$kernel"
	flock 9
	build_agent
	stage_files
	bootstrap
	make_disk
	write_json
	rm -rf "$out.tmp"
	mkdir -p "$out.tmp"
	mv "$tmp/disk.qcow2" "$tmp/vmlinuz" "$tmp/initrd.img" "$out.tmp/"
	mv "$tmp/image.json" "$out.tmp/image.json"
	mv "$out.tmp" "$out"
	ln -sfn "$(basename "$out")" "$cache/disk/$kernel"
	prune_older "$out"
	log "built $out in $((SECONDS - start)) s ($(du -h "$out/disk.qcow2" | cut -f1) qcow2)"
	echo "$out"
}

if [ "${1:-}" = --customize ]; then
	customize "$2" "$3"
	exit 0
fi
main
