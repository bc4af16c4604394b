#!/usr/bin/env bash
# Build thinvm's Debian packages with dpkg-deb and keep them in a flat
# local apt repository (docs/install.md):
#
#   thinvm-qemu          the patched QEMU 10.0 of qemu/build.sh, under
#                        /usr/lib/thinvm-qemu (Debian's qemu-system-x86
#                        stays as it is)
#   thinvm               the control plane, /usr/bin/thinvm, systemd units
#                        for the balance controller and the warm pool
#   thinvm-guest-agent   the guest agent and reclaimer, for Debian guests
#   thinvm-balloon-dkms  our balloon driver as DKMS source (guest/balloon)
#   thinvm-qemu-default  opt-in: diverts Debian's /usr/bin/qemu-system-x86_64
#                        and links thinvm-qemu's emulator in its place, for
#                        tooling that cannot name an emulator (Nova)
#
# QEMU is not built here: thinvm-qemu packages the existing patched build
# ($THINVM_CACHE/qemu/patched) and refuses one that is not of the current
# qemu/series.  Each package is rebuilt only when its inputs changed (a
# hash of them is kept next to the repository), so a warm run takes a
# second or two.
#
# The repository is unsigned, for `[trusted=yes]`: it is a file: URI on
# the host that built it, writable by root only, so a signature would
# protect nothing a local root could not replace.  Serve it to other
# hosts over a network only signed (docs/install.md says how).
#
# Usage: packaging/build-debs.sh [--repo DIR] [PACKAGE...]
#   default: all four packages into $THINVM_CACHE/apt-repo
# Prints the path of each named package's .deb on stdout, one a line.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(dirname "$here")
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
venv=${THINVM_VENV:-$cache/venv}
repo=$cache/apt-repo
all=(thinvm-qemu thinvm thinvm-guest-agent thinvm-balloon-dkms thinvm-qemu-default)
# DKMS module name and version (dkms.conf), for the DKMS package's scripts.
dkms_name="" dkms_version=""

log() { printf '[packaging] %s\n' "$*" >&2; }
die() { printf '[packaging] error: %s\n' "$*" >&2; exit 1; }

usage() {
	echo "usage: packaging/build-debs.sh [--repo DIR] [${all[*]}]" >&2
	exit 2
}

wanted=()
while [ $# -gt 0 ]; do
	case $1 in
	--repo) [ $# -ge 2 ] || usage; repo=$2; shift 2 ;;
	-h|--help) usage ;;
	-*) log "unknown option '$1'"; usage ;;
	*) wanted+=("$1"); shift ;;
	esac
done
[ ${#wanted[@]} -gt 0 ] || wanted=("${all[@]}")
# Debian's DEBFULLNAME/DEBEMAIL, else whoever last committed packaging/:
# the same sources give the same Maintainer field.
if [ -n "${DEBEMAIL:-}" ]; then
	maintainer="${DEBFULLNAME:-thinvm} <$DEBEMAIL>"
else
	maintainer=$(git -C "$top" log -1 --format='%an <%ae>' -- packaging 2>/dev/null || true)
	[ -n "$maintainer" ] || die "no maintainer: set DEBFULLNAME and DEBEMAIL"
fi
for p in "${wanted[@]}"; do
	case " ${all[*]} " in *" $p "*) ;; *) die "unknown package '$p' (${all[*]})" ;; esac
done

for tool in dpkg-deb dpkg-shlibdeps dpkg-scanpackages strip; do
	command -v "$tool" >/dev/null || die "$tool not found: apt-get install dpkg-dev binutils"
done

# Commits that touched PATHS: it grows with every committed change, so
# package versions sort in the order their sources were committed.
commits() {
	git -C "$top" rev-list --count HEAD -- "$@" 2>/dev/null || echo 0
}

# Time of the last commit that touched PATHS (0 outside git): the
# timestamp of every file in the package, so the same sources give the
# same .deb.
commit_time() {
	local t
	t=$(git -C "$top" log -1 --format=%ct -- "$@" 2>/dev/null || true)
	echo "${t:-0}"
}

# Hash of files and directories, by content and by path relative to the
# repository (not by where the checkout is), plus any extra words.
inputs_hash() {
	local extra=$1
	shift
	{
		echo "$extra"
		find "$@" -type f ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum |
			sed "s| $top/| |"
	} | sha256sum | cut -c1-12
}

# Is the .deb of PKG for inputs HASH in the repository already?
cached() {
	local hash=$2 stamp=$repo/.inputs/$1 have deb
	[ -f "$stamp" ] || return 1
	read -r have deb <"$stamp" || return 1
	[ "$have" = "$hash" ] && [ -f "$repo/$deb" ]
}

# Record PKG's new .deb for inputs HASH and drop its older versions.
publish() {
	local pkg=$1 hash=$2 deb=$3 old
	mv "$deb" "$repo/"
	for old in "$repo/${pkg}"_*.deb; do
		[ "$old" = "$repo/$(basename "$deb")" ] || rm -f "$old"
	done
	mkdir -p "$repo/.inputs"
	echo "$hash $(basename "$deb")" >"$repo/.inputs/$pkg"
	changed=1
}

# Shared-library dependencies of the ELF files given, as dpkg-shlibdeps
# finds them (it wants a debian/control and the files under debian/PKG).
#   shlibs STAGE PKG FILE...   (FILEs relative to STAGE/debian/PKG)
shlibs() {
	local stage=$1 pkg=$2
	shift 2
	printf 'Source: thinvm\n\nPackage: %s\nArchitecture: any\n' "$pkg" >"$stage/debian/control"
	(cd "$stage" && dpkg-shlibdeps -O "${@/#/debian/$pkg/}" 2>/dev/null) |
		sed -n 's/^shlibs:Depends=//p'
	rm -f "$stage/debian/control"
}

# The files every package carries: copyright and a changelog (native
# versions: changelog.gz), then the control file from its template, the
# md5sums, fixed permissions and timestamps, and the .deb itself.
#   assemble STAGE PKG VERSION EPOCH DEPENDS
assemble() {
	local stage=$1 pkg=$2 version=$3 epoch=$4 depends=$5 root=$1/debian/$2 size
	local doc=$root/usr/share/doc/$pkg
	mkdir -p "$doc" "$root/DEBIAN"
	install -m 0644 "$here/copyright" "$doc/copyright"
	if [ -f "$here/$pkg/lintian-overrides" ]; then
		install -D -m 0644 "$here/$pkg/lintian-overrides" \
			"$root/usr/share/lintian/overrides/$pkg"
	fi
	{
		echo "$pkg ($version) unstable; urgency=medium"
		echo
		echo "  * Built from the thinvm repository by packaging/build-debs.sh."
		echo
		echo " -- $maintainer  $(LC_ALL=C date -u -R -d "@$epoch")"
	} | gzip -9n >"$doc/changelog.gz"
	chmod 0644 "$doc/changelog.gz"
	size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
	sed -e "s|@VERSION@|$version|" -e "s|@DEPENDS@|$depends|" \
		-e "s|@SIZE@|$size|" -e "s|@MAINTAINER@|$maintainer|" \
		"$here/$pkg/control" >"$root/DEBIAN/control"
	local f
	for f in preinst postinst prerm postrm; do
		if [ -f "$here/$pkg/$f" ]; then
			sed -e "s|@DKMS_NAME@|$dkms_name|g" -e "s|@DKMS_VERSION@|$dkms_version|g" \
				"$here/$pkg/$f" >"$root/DEBIAN/$f"
			chmod 0755 "$root/DEBIAN/$f"
		fi
	done
	# Everything under /etc is a conffile.
	if [ -d "$root/etc" ]; then
		(cd "$root" && find etc -type f | sed 's|^|/|' | sort) >"$root/DEBIAN/conffiles"
		chmod 0644 "$root/DEBIAN/conffiles"
	fi
	(cd "$root" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z |
		xargs -0 -r md5sum) >"$root/DEBIAN/md5sums"
	chmod 0644 "$root/DEBIAN/md5sums" "$root/DEBIAN/control"
	find "$root" -type d -exec chmod 0755 {} +
	find "$root" -exec touch -h -d "@$epoch" {} +
	local arch
	arch=$(sed -n 's/^Architecture: //p' "$root/DEBIAN/control")
	deb=$stage/${pkg}_${version}_$arch.deb
	SOURCE_DATE_EPOCH=$epoch dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
}

# The hash qemu/build.sh gives the patched build: the series file and
# every patch it lists, in order.
series_hash() {
	local p
	{
		cat "$top/qemu/series"
		while read -r p; do
			case "$p" in ''|'#'*) continue ;; esac
			cat "$top/qemu/patches/$p"
		done <"$top/qemu/series"
	} | sha256sum | cut -c1-12
}

build_thinvm_qemu() {
	local pkg=thinvm-qemu build=$cache/qemu/patched stage
	if [ ! -f "$build/build.json" ] || [ ! -x "$build/qemu-system-x86_64" ]; then
		die "no patched QEMU build in $build: run qemu/build.sh patched (or make setup)"
	fi
	local built want
	built=$("$venv/bin/python3" -c 'import json, sys; print(json.load(open(sys.argv[1]))["patch_hash"])' \
		"$build/build.json" 2>/dev/null || sed -n 's/.*"patch_hash": "\([0-9a-f]*\)".*/\1/p' "$build/build.json")
	want=$(series_hash)
	[ "$built" = "$want" ] ||
		die "the patched build in $build is of series $built, qemu/series is $want: run qemu/build.sh patched"
	local hash
	hash=$(inputs_hash "$want" "$build/qemu-system-x86_64" "$here/$pkg" "$here/copyright" \
		"$here/build-debs.sh")
	if cached "$pkg" "$hash"; then
		return
	fi
	log "building $pkg (series $want)"
	local debver upstream version epoch
	debver=$(sed -n 's/.*"debian_version": "\([^"]*\)".*/\1/p' "$build/build.json")
	upstream=${debver#*:}
	upstream=${upstream%%+*}
	version=$upstream+thinvm$(commits qemu packaging).$hash
	epoch=$(commit_time qemu packaging)
	stage=$work/$pkg
	mkdir -p "$stage/debian"
	local root=$stage/debian/$pkg lib=/usr/lib/thinvm-qemu
	mkdir -p "$root$lib/bin" "$root/usr/bin" "$root/usr/share/man/man1" \
		"$root/usr/share/doc/$pkg/patches"
	# Debug information stays out (80 MB of the 100): the package is the
	# binary a host runs.
	strip --strip-unneeded --remove-section=.comment -o "$root$lib/bin/qemu-system-x86_64" \
		"$build/qemu-system-x86_64"
	chmod 0755 "$root$lib/bin/qemu-system-x86_64"
	ln -s "../lib/thinvm-qemu/bin/qemu-system-x86_64" "$root/usr/bin/thinvm-qemu-system-x86_64"
	# What `thinvm version` and thinvm.qemu.builds read on a host without
	# the build cache.
	sed -e "s|\"binary\": \"[^\"]*\"|\"binary\": \"$lib/bin/qemu-system-x86_64\"|" \
		"$build/build.json" >"$root$lib/build.json"
	chmod 0644 "$root$lib/build.json"
	# The series itself: what the binary is, and the corresponding source
	# together with Debian's qemu source package (GPL-2).
	local p subjects=""
	while read -r p; do
		case "$p" in ''|'#'*) continue ;; esac
		gzip -9nc "$top/qemu/patches/$p" >"$root/usr/share/doc/$pkg/patches/$p.gz"
		# The Subject header, unfolded.
		subjects+=$(awk '/^Subject: / { s = $0; while ((getline l) > 0 && l ~ /^[ \t]/) s = s l; print s; exit }' \
			"$top/qemu/patches/$p" | sed -e 's/^Subject: \[PATCH [0-9]*\/[0-9]*\] //' -e 's/[ \t]\+/ /g')
		subjects+=$'\n'
	done <"$top/qemu/series"
	install -m 0644 "$top/qemu/series" "$root/usr/share/doc/$pkg/patches/series"
	# The man page lists the series, one line a patch.
	local list
	list=$(printf '%s' "$subjects" | sed -e 's/\\/\\e/g' -e 's/^\./\\\&./' -e 's/^/.IP \\(bu 2\n/')
	list=".PD 0"$'\n'"$list"$'\n'".PD"
	awk -v list="$list" '$0 == "@PATCHES@" { print list; next } { print }' \
		"$here/$pkg/thinvm-qemu-system-x86_64.1" |
		sed -e "s|@VERSION@|$version|" -e "s|@DEBIAN_VERSION@|$debver|" -e "s|@SERIES@|$want|" |
		gzip -9n >"$root/usr/share/man/man1/thinvm-qemu-system-x86_64.1.gz"
	install -m 0644 "$here/$pkg/README.Debian" "$root/usr/share/doc/$pkg/README.Debian"
	assemble "$stage" "$pkg" "$version" "$epoch" \
		"$(shlibs "$stage" "$pkg" "${lib#/}/bin/qemu-system-x86_64")"
	publish "$pkg" "$hash" "$deb"
}

# The opt-in: a link where Debian's emulator was, the diversion done by
# its maintainer scripts.  Nothing but the link and the docs.
build_qemu_default() {
	local pkg=thinvm-qemu-default stage hash
	hash=$(inputs_hash "" "$here/$pkg" "$here/copyright" "$here/build-debs.sh")
	if cached "$pkg" "$hash"; then
		return
	fi
	log "building $pkg"
	local version epoch
	version=0.1+$(commits packaging/$pkg).$hash
	epoch=$(commit_time packaging/$pkg)
	stage=$work/$pkg
	mkdir -p "$stage/debian"
	local root=$stage/debian/$pkg
	mkdir -p "$root/usr/bin" "$root/usr/share/doc/$pkg"
	ln -s ../lib/thinvm-qemu/bin/qemu-system-x86_64 "$root/usr/bin/qemu-system-x86_64"
	install -m 0644 "$here/$pkg/README.Debian" "$root/usr/share/doc/$pkg/README.Debian"
	assemble "$stage" "$pkg" "$version" "$epoch" "thinvm-qemu"
	publish "$pkg" "$hash" "$deb"
}

# qemu.qmp (QEMU's own QMP library, thinvm's one dependency) is not in
# Debian 12: the package carries the copy the venv installed, next to
# thinvm, in a private directory.
qmp_dir() {
	"$venv/bin/python3" -c 'import os, qemu.qmp; print(os.path.dirname(qemu.qmp.__file__))' ||
		die "qemu.qmp not found in $venv: run make setup"
}

build_thinvm() {
	local pkg=thinvm stage qmp
	qmp=$(qmp_dir)
	local docs=(install.md balance.md warm-pool.md fleet.md working-set.md architecture.md)
	local hash
	hash=$(inputs_hash "" "$top/thinvm" "$qmp" "$here/$pkg" "$here/copyright" \
		"$here/build-debs.sh" "$top/pyproject.toml" "$top/docs")
	if cached "$pkg" "$hash"; then
		return
	fi
	log "building $pkg"
	local base version epoch
	base=$(sed -n 's/^version = "\(.*\)"/\1/p' "$top/pyproject.toml")
	version=$base+$(commits thinvm packaging).$hash
	epoch=$(commit_time thinvm packaging)
	stage=$work/$pkg
	mkdir -p "$stage/debian"
	local root=$stage/debian/$pkg py=/usr/lib/thinvm/python
	mkdir -p "$root$py/qemu" "$root/usr/bin" "$root/lib/systemd/system" "$root/etc/thinvm" \
		"$root/usr/share/man/man1" "$root/usr/share/doc/$pkg"
	# Sources only: postinst compiles them for the python3 the host has.
	# Not the benchmarks (thinvm/bench: `thinvm bench` runs from a source
	# tree, where their records and docs are) nor what only the test suite
	# runs (thinvm/testing: its guest profile and kept boots).
	(cd "$top" && find thinvm \( -path thinvm/bench -o -path thinvm/testing \) -prune -o \
		\( -name '*.py' -o -name py.typed \) -print) |
		while read -r f; do install -D -m 0644 "$top/$f" "$root$py/$f"; done
	# qmp_tui needs urwid, which thinvm never uses.
	(cd "$(dirname "$qmp")" && find qmp -name '*.py' ! -name qmp_tui.py -o -name py.typed) |
		while read -r f; do install -D -m 0644 "$qmp/../$f" "$root$py/qemu/$f"; done
	install -m 0755 "$here/$pkg/thinvm" "$root/usr/bin/thinvm"
	install -m 0644 "$here/$pkg"/*.service "$root/lib/systemd/system/"
	install -m 0644 "$here/$pkg/balance.conf" "$here/$pkg/pool.conf" "$root/etc/thinvm/"
	gzip -9nc "$here/$pkg/thinvm.1" >"$root/usr/share/man/man1/thinvm.1.gz"
	local d
	for d in "${docs[@]}"; do
		if [ -f "$top/docs/$d" ]; then
			gzip -9nc "$top/docs/$d" >"$root/usr/share/doc/$pkg/$d.gz"
		fi
	done
	assemble "$stage" "$pkg" "$version" "$epoch" ""
	publish "$pkg" "$hash" "$deb"
}

build_guest_agent() {
	local pkg=thinvm-guest-agent stage src=$top/guest/agent
	# Every hardening flag, bindnow included.
	export DEB_BUILD_MAINT_OPTIONS=hardening=+all
	local hash
	hash=$(inputs_hash "$(dpkg-buildflags --get CFLAGS) $(dpkg-buildflags --get LDFLAGS)" \
		"$src"/*.[ch] "$src/Makefile" "$here/$pkg" "$here/copyright" "$here/build-debs.sh" \
		"$top/docs/protocol/agent.md" "$top/docs/working-set.md")
	if cached "$pkg" "$hash"; then
		return
	fi
	log "building $pkg"
	local version epoch
	version=0.1.0+$(commits guest/agent packaging).$hash
	epoch=$(commit_time guest/agent packaging)
	stage=$work/$pkg
	mkdir -p "$stage/debian"
	local root=$stage/debian/$pkg
	# Dynamically linked and hardened the Debian way (the initramfs keeps
	# its static build): the Makefile's own flags are replaced whole.
	local cflags ldflags
	cflags="$(dpkg-buildflags --get CPPFLAGS) $(dpkg-buildflags --get CFLAGS) -std=gnu11 -Wall -Wextra"
	ldflags=$(dpkg-buildflags --get LDFLAGS)
	make -s -C "$src" O="$stage/build" CFLAGS="$cflags" LDFLAGS="$ldflags" \
		"$stage/build/thinvm-agent" >&2
	mkdir -p "$root/usr/sbin" "$root/lib/systemd/system" "$root/etc/default" \
		"$root/usr/share/doc/$pkg"
	install -m 0755 "$stage/build/thinvm-agent" "$root/usr/sbin/thinvm-agent"
	strip --strip-unneeded --remove-section=.comment "$root/usr/sbin/thinvm-agent"
	install -m 0644 "$here/$pkg/thinvm-agent.service" "$root/lib/systemd/system/"
	install -m 0644 "$here/$pkg/thinvm-agent.default" "$root/etc/default/thinvm-agent"
	mkdir -p "$root/usr/share/man/man8"
	gzip -9nc "$here/$pkg/thinvm-agent.8" >"$root/usr/share/man/man8/thinvm-agent.8.gz"
	gzip -9nc "$top/docs/protocol/agent.md" >"$root/usr/share/doc/$pkg/agent.md.gz"
	gzip -9nc "$top/docs/working-set.md" >"$root/usr/share/doc/$pkg/working-set.md.gz"
	assemble "$stage" "$pkg" "$version" "$epoch" \
		"$(shlibs "$stage" "$pkg" usr/sbin/thinvm-agent)"
	publish "$pkg" "$hash" "$deb"
}

build_balloon_dkms() {
	local pkg=thinvm-balloon-dkms src=$top/guest/balloon stage
	dkms_name=$(sed -n 's/^PACKAGE_NAME="\(.*\)"/\1/p' "$src/dkms.conf")
	dkms_version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"/\1/p' "$src/dkms.conf")
	if [ -z "$dkms_name" ] || [ -z "$dkms_version" ]; then
		die "no PACKAGE_NAME/PACKAGE_VERSION in $src/dkms.conf"
	fi
	local hash
	hash=$(inputs_hash "" "$src"/*.[ch] "$src/Makefile" "$src/dkms.conf" \
		"$src/thinvm-balloon.conf" "$here/$pkg" "$here/copyright" "$here/build-debs.sh")
	if cached "$pkg" "$hash"; then
		return
	fi
	log "building $pkg"
	local version epoch
	# The package's version moves with its sources; DKMS' stays that of
	# dkms.conf (the prerm removes it, the next postinst builds it again).
	version=$dkms_version+$(commits guest/balloon packaging).$hash
	epoch=$(commit_time guest/balloon packaging)
	stage=$work/$pkg
	local root=$stage/debian/$pkg
	local usrc=$root/usr/src/$dkms_name-$dkms_version
	mkdir -p "$usrc" "$root/etc/modprobe.d" "$root/etc/modules-load.d"
	# The module sources and their build files; nothing host-specific.
	install -m 0644 "$src"/*.c "$src"/*.h "$src/Makefile" "$src/dkms.conf" \
		"$src/thinvm-balloon.conf" "$usrc/"
	install -m 0644 "$src/thinvm-balloon.conf" "$root/etc/modprobe.d/thinvm-balloon.conf"
	echo thinvm_balloon >"$root/etc/modules-load.d/thinvm-balloon.conf"
	chmod 0644 "$root/etc/modules-load.d/thinvm-balloon.conf"
	assemble "$stage" "$pkg" "$version" "$epoch" ""
	publish "$pkg" "$hash" "$deb"
}

# Packages, Packages.gz and a Release file for a flat repository
# (`deb [trusted=yes] file:DIR ./`); apt-ftparchive is not needed for one.
write_index() {
	(cd "$repo" && dpkg-scanpackages --multiversion . /dev/null 2>/dev/null) >"$repo/Packages.tmp"
	mv "$repo/Packages.tmp" "$repo/Packages"
	gzip -9nc "$repo/Packages" >"$repo/Packages.gz"
	{
		echo "Origin: thinvm"
		echo "Label: thinvm"
		echo "Suite: local"
		echo "Codename: local"
		echo "Architectures: amd64 all"
		echo "Date: $(LC_ALL=C date -u -R)"
		echo "Description: thinvm packages built by packaging/build-debs.sh"
		echo "SHA256:"
		local f
		for f in Packages Packages.gz; do
			printf ' %s %s %s\n' "$(sha256sum <"$repo/$f" | cut -d' ' -f1)" \
				"$(stat -c %s "$repo/$f")" "$f"
		done
	} >"$repo/Release"
}

mkdir -p "$repo"
work=$(mktemp -d "${TMPDIR:-/tmp}/thinvm-deb.XXXXXX")
trap 'rm -rf "$work"' EXIT
exec 9>"$repo/.lock"
flock 9
changed=0
for p in "${wanted[@]}"; do
	case $p in
	thinvm-qemu) build_thinvm_qemu ;;
	thinvm) build_thinvm ;;
	thinvm-guest-agent) build_guest_agent ;;
	thinvm-balloon-dkms) build_balloon_dkms ;;
	thinvm-qemu-default) build_qemu_default ;;
	esac
done
if [ "$changed" = 1 ] || [ ! -f "$repo/Release" ]; then
	write_index
	log "repository $repo: $(find "$repo" -maxdepth 1 -name '*.deb' | wc -l) packages"
fi
for p in "${wanted[@]}"; do
	read -r _ deb <"$repo/.inputs/$p"
	echo "$repo/$deb"
done
