#!/usr/bin/env bash
# Build the thinvm test guest: Debian's current stable kernel and a small
# busybox initramfs that loads the virtio drivers and runs thinvm-agent.
#
# The kernel comes from Debian's linux-image-amd64 metapackage (bookworm
# for 6.1, bookworm-backports for 6.12), so the guest is the kernel real
# Debian 12 users run.  Everything is cached under $THINVM_CACHE (default
# ~/.cache/thinvm); an image whose inputs did not change is not rebuilt.
#
# Usage: guest/image/build.sh [--kernel 6.1|6.12] [--balloon stock|none|KO]
#
#   --balloon stock  Debian's virtio_balloon module (default)
#   --balloon none   no balloon driver in the image
#   --balloon KO     this virtio_balloon.ko instead of Debian's, loaded last;
#                    Debian's is in the image too, not loaded, as
#                    /lib/modules/thinvm/intree/virtio_balloon.ko, for
#                    tests that swap drivers in a running guest
#
# The last line on stdout is the image directory, holding vmlinuz,
# initramfs.cpio.gz and image.json.  Progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
apt=$top/scripts/debian-apt.sh
agent_src=$top/guest/agent

# Modules the guest needs beyond what the kernel has built in.  virtio_blk:
# tests attach scratch disks, whose reads fill a real, reclaimable page
# cache (the initramfs root is not).  virtio_mem: VMs started with
# --virtio-mem grow and shrink by plugging memory blocks (docs/resize.md);
# without such a device the module loads and stays idle.
base_modules=(virtio_pci virtio_console virtio_blk virtio_mem)

log() { printf '[guest/image] %s\n' "$*" >&2; }
die() { printf '[guest/image] error: %s\n' "$*" >&2; exit 1; }

usage() {
	echo "usage: guest/image/build.sh [--kernel 6.1|6.12] [--balloon stock|none|KO]" >&2
	exit 2
}

kernel=6.1
balloon=stock
while [ $# -gt 0 ]; do
	case $1 in
	--kernel) [ $# -ge 2 ] || usage; kernel=$2; shift 2 ;;
	--balloon) [ $# -ge 2 ] || usage; balloon=$2; shift 2 ;;
	-h|--help) usage ;;
	*) log "unknown argument '$1'"; usage ;;
	esac
done

case $kernel in
6.1) suite=bookworm ;;
6.12) suite=bookworm-backports ;;
*) die "--kernel $kernel: want 6.1 or 6.12" ;;
esac

balloon_ko=
case $balloon in
stock|none) ;;
*)
	[ -f "$balloon" ] || die "--balloon $balloon: want stock, none or a .ko file"
	balloon_ko=$(realpath "$balloon")
	;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/thinvm-image.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# True if metapackage version $1 is the $kernel series from $suite.
in_suite() {
	[[ $1 == "$kernel".* ]] || return 1
	# Backports versions carry ~bpo12; the stable suite's never do.
	if [ "$suite" = bookworm-backports ]; then
		[[ $1 == *~bpo12* ]]
	else
		[[ $1 != *~bpo* ]]
	fi
}

# Prints "META KPKG KPKG_VERSION": the newest matching linux-image-amd64
# and the kernel package it depends on.  One apt-cache call covers all
# versions; each call costs about a second.
query_kernel() {
	local meta= v dep best_dep=
	while read -r v dep; do
		in_suite "$v" || continue
		if [ -z "$meta" ] || dpkg --compare-versions "$v" gt "$meta"; then
			meta=$v
			best_dep=$dep
		fi
	done < <("$apt" show linux-image-amd64 2>/dev/null | awk '
		/^Version: / { v = $2 }
		/^Depends: / {
			n = split(substr($0, 10), deps, ",")
			for (i = 1; i <= n; i++)
				if (match(deps[i], /linux-image-[^ ]+ *\(= *[^)]+\)/)) {
					d = substr(deps[i], RSTART, RLENGTH)
					gsub(/[(=)]/, " ", d)
					split(d, f, " ")
					print v, f[1], f[2]
					break
				}
		}')
	[ -n "$meta" ] || die "no linux-image-amd64 $kernel in $suite: run scripts/debian-apt.sh update"
	echo "$meta $best_dep"
}

# Sets kpkg, kpkg_version and kver.  The answer only changes when the apt
# lists do, so it is remembered until they are refreshed: that keeps an
# up-to-date rebuild well under 2 s.
resolve_kernel() {
	local memo=$cache/image/.kernel-$kernel lists=$cache/apt/lists meta
	"$apt" update || log "warning: apt update failed, using the lists as they are"
	if [ ! -s "$memo" ] || [ -n "$(find "$lists" -newer "$memo" -print -quit)" ]; then
		mkdir -p "$cache/image"
		query_kernel >"$tmp/kernel"
		cp "$tmp/kernel" "$memo.$$"
		mv "$memo.$$" "$memo"
	fi
	read -r meta kpkg kpkg_version <"$memo"
	kver=${kpkg#linux-image-}
	log "kernel $kernel: linux-image-amd64 $meta -> $kpkg $kpkg_version"
}

fetch_kernel() {
	local debs=$cache/debs dl
	deb=$debs/${kpkg}_${kpkg_version}_amd64.deb
	[ -f "$deb" ] && return
	log "downloading $kpkg=$kpkg_version"
	mkdir -p "$debs"
	# Download aside and rename, so a parallel build never sees half a file.
	dl=$(mktemp -d "$debs/.dl.XXXXXX")
	if ! (cd "$dl" && "$apt" download "$kpkg=$kpkg_version"); then
		rm -rf "$dl"
		die "download of $kpkg=$kpkg_version failed"
	fi
	mv "$dl"/*.deb "$deb"
	rm -rf "$dl"
}

# Sets kroot: the directory holding lib/modules/$kver.
extract_kernel() {
	local kdir=$cache/kernel/$kpkg_version
	local stamp=$kdir/.extracted-$kpkg
	if [ ! -f "$stamp" ]; then
		log "extracting $(basename "$deb")"
		mkdir -p "$kdir"
		dpkg-deb -x "$deb" "$kdir"
	fi
	kboot=$kdir/boot
	if [ -d "$kdir/lib/modules/$kver" ]; then
		kroot=$kdir
	elif [ -d "$kdir/usr/lib/modules/$kver" ]; then
		kroot=$kdir/usr
	else
		die "$deb has no modules for $kver"
	fi
	[ -f "$kboot/vmlinuz-$kver" ] || die "$deb has no vmlinuz-$kver"
	if [ ! -f "$stamp" ]; then
		# Debian generates modules.dep in postinst; the .deb lacks it.
		depmod -b "$kroot" "$kver"
		touch "$stamp"
	fi
}

# Appends NAME PATH lines for a module and its dependencies, in load
# order, to $tmp/modules; built-in ones go to $tmp/builtin.
resolve_module() {
	local out
	out=$(modprobe -C /dev/null -d "$kroot" -S "$kver" --show-depends "$1" 2>&1) ||
		die "module $1 not found for $kver: $out"
	awk -v mods="$tmp/modules" -v builtin="$tmp/builtin" '
		$1 == "builtin" { print $2 >> builtin }
		$1 == "insmod" {
			n = $2; sub(/.*\//, "", n); sub(/\.ko(\.(xz|zst|gz))?$/, "", n)
			gsub(/-/, "_", n)
			print n, $2 >> mods
		}' <<<"$out"
}

check_custom_ko() {
	local magic deps d
	magic=$(modinfo -F vermagic "$balloon_ko" | awk '{ print $1 }')
	[ "$magic" = "$kver" ] ||
		die "$balloon_ko is built for '$magic', kernel is $kver: rebuild it or pass --kernel"
	deps=$(modinfo -F depends "$balloon_ko")
	for d in ${deps//,/ }; do
		resolve_module "$d"
	done
}

# With our driver in the image, Debian's virtio_balloon goes in as well,
# unloaded: $tmp/intree gets its path.  Its dependencies (virtio,
# virtio_ring) are those of virtio_pci, which is always loaded.
intree_balloon() {
	modprobe -C /dev/null -d "$kroot" -S "$kver" --show-depends virtio_balloon 2>/dev/null |
		awk '$1 == "insmod" && $2 ~ /\/virtio_balloon\.ko/ { print $2 }' >"$tmp/intree"
	[ -s "$tmp/intree" ] || log "warning: no virtio_balloon module in $kver to add unloaded"
}

# Writes $tmp/modlist: NAME PATH, deduplicated, in load order.
resolve_modules() {
	local m
	: >"$tmp/modules"
	: >"$tmp/builtin"
	: >"$tmp/intree"
	for m in "${base_modules[@]}"; do
		resolve_module "$m"
	done
	case $balloon in
	stock) resolve_module virtio_balloon ;;
	none)
		if modprobe -C /dev/null -d "$kroot" -S "$kver" --show-depends \
			virtio_balloon 2>/dev/null | grep -q '^builtin'; then
			log "warning: virtio_balloon is built into $kver; --balloon none cannot remove it"
		fi
		;;
	*)
		check_custom_ko
		intree_balloon
		;;
	esac
	awk '!seen[$1]++' "$tmp/modules" >"$tmp/modlist"
	if [ -n "$balloon_ko" ]; then
		grep -v '^virtio_balloon ' "$tmp/modlist" >"$tmp/modlist.new" || true
		echo "virtio_balloon $balloon_ko" >>"$tmp/modlist.new"
		mv "$tmp/modlist.new" "$tmp/modlist"
	fi
	sort -u "$tmp/builtin" -o "$tmp/builtin"
}

# Everything the image is made from; unchanged inputs mean no rebuild.
inputs_hash() {
	{
		echo "$kpkg $kpkg_version $balloon_variant"
		cat "$tmp/modlist" "$tmp/intree"
		sha256sum "$here/build.sh" "$here/init" "$(command -v busybox)" \
			"$agent_src"/*.[ch] "$agent_src"/Makefile "$agent_src"/build-cached.sh \
			${balloon_ko:+"$balloon_ko"} |
			awk '{ print $1 }'
	} | sha256sum | awk '{ print $1 }'
}

build_agent() {
	log "building thinvm-agent and thinvm-mem"
	agent_bin=$("$agent_src/build-cached.sh")
}

add_busybox() {
	local bb a
	bb=$(command -v busybox) || die "busybox not found: apt-get install busybox-static"
	if readelf -l "$bb" 2>/dev/null | grep -q 'program interpreter'; then
		die "$bb is dynamically linked: apt-get install busybox-static"
	fi
	cp "$bb" "$root/bin/busybox"
	for a in $("$bb" --list); do
		[ "$a" = busybox ] || ln -sf busybox "$root/bin/$a"
	done
}

# busybox insmod wants plain ELF; Debian 6.12 ships .ko.xz.
copy_module() {
	case $1 in
	*.ko.xz) xz -dc "$1" >"$2" ;;
	*.ko.zst) zstd -qdc "$1" >"$2" ;;
	*.ko.gz) gzip -dc "$1" >"$2" ;;
	*) cp "$1" "$2" ;;
	esac
}

add_modules() {
	local name path
	mkdir -p "$root/lib/modules/thinvm"
	: >"$root/etc/thinvm/modules"
	while read -r name path; do
		copy_module "$path" "$root/lib/modules/thinvm/$name.ko"
		echo "$name" >>"$root/etc/thinvm/modules"
	done <"$tmp/modlist"
	if [ -s "$tmp/intree" ]; then
		mkdir -p "$root/lib/modules/thinvm/intree"
		copy_module "$(cat "$tmp/intree")" "$root/lib/modules/thinvm/intree/virtio_balloon.ko"
	fi
}

json_list() {
	local sep= item
	printf '['
	for item in "$@"; do
		printf '%s"%s"' "$sep" "$item"
		sep=,
	done
	printf ']'
}

write_image_json() {
	local mods builtin
	mapfile -t mods < <(awk '{ print $1 }' "$tmp/modlist")
	mapfile -t builtin <"$tmp/builtin"
	{
		printf '{"kernel_version":"%s","kernel_package":"%s",' "$kver" "$kpkg"
		printf '"package_version":"%s","balloon":"%s",' "$kpkg_version" "$balloon_json"
		printf '"modules":%s,' "$(json_list "${mods[@]}")"
		printf '"builtin_modules":%s,' "$(json_list "${builtin[@]}")"
		printf '"inputs":"%s"}\n' "$hash"
	} >"$1"
}

build_initramfs() {
	root=$tmp/root
	mkdir -p "$root"/{bin,dev,etc/thinvm,lib,proc,root,run,sys,tmp,usr}
	ln -s bin "$root/sbin"
	ln -s ../bin "$root/usr/bin"
	ln -s ../bin "$root/usr/sbin"
	add_busybox
	cp "$agent_bin/thinvm-agent" "$agent_bin/thinvm-mem" "$root/bin/"
	add_modules
	install -m 0755 "$here/init" "$root/init"
	write_image_json "$root/etc/thinvm/image.json"
	log "packing initramfs ($(wc -l <"$tmp/modlist") modules)"
	(cd "$root" && find . | LC_ALL=C sort |
		cpio -o -H newc -R 0:0 --quiet) | gzip -6 -n >"$tmp/initramfs.cpio.gz"
}

# Files are renamed into place one by one, image.json last, so a reader
# never sees a new kernel with an old initramfs described as complete.
install_image() {
	mkdir -p "$out"
	rm -f "$out/image.json"
	cp "$kboot/vmlinuz-$kver" "$tmp/vmlinuz"
	mv "$tmp/vmlinuz" "$out/vmlinuz"
	mv "$tmp/initramfs.cpio.gz" "$out/initramfs.cpio.gz"
	cp "$root/etc/thinvm/image.json" "$tmp/image.json"
	mv "$tmp/image.json" "$out/image.json"
}

main() {
	local start=$SECONDS ko_sum
	resolve_kernel
	fetch_kernel
	extract_kernel
	case $balloon in
	stock|none) balloon_variant=$balloon; balloon_json=$balloon ;;
	*)
		ko_sum=$(sha256sum "$balloon_ko" | awk '{ print $1 }')
		balloon_variant=ko-${ko_sum:0:12}
		balloon_json=$ko_sum
		;;
	esac
	resolve_modules
	hash=$(inputs_hash)
	out=$cache/image/$kpkg_version-$balloon_variant
	if [ -f "$out/image.json" ] && grep -q "\"inputs\":\"$hash\"" "$out/image.json"; then
		log "up to date: $out"
		echo "$out"
		return
	fi
	build_agent
	build_initramfs
	install_image
	log "built $out in $((SECONDS - start)) s"
	echo "$out"
}

main
