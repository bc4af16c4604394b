#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0
#
# Build thinvm-balloon-dkms_<version>_all.deb: the driver's source under
# /usr/src for DKMS, plus the modprobe.d blacklist of the in-tree
# virtio_balloon and a modules-load.d entry for thinvm_balloon.  This is
# how a user installs the driver on a Debian guest:
#
#   apt-get install ./thinvm-balloon-dkms_0.1_all.deb
#
# The postinst builds and installs the module for every installed kernel
# that has headers; DKMS' own kernel hooks cover kernels installed later.
#
# Usage: mkdeb.sh OUTDIR     (prints the .deb path on the last line)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: mkdeb.sh OUTDIR}

name=$(sed -n 's/^PACKAGE_NAME="\(.*\)"/\1/p' "$here/dkms.conf")
version=$(sed -n 's/^PACKAGE_VERSION="\(.*\)"/\1/p' "$here/dkms.conf")
[ -n "$name" ] && [ -n "$version" ] || {
	echo "mkdeb: no PACKAGE_NAME/PACKAGE_VERSION in dkms.conf" >&2
	exit 1
}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/thinvm-dkms.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
src=$root/usr/src/$name-$version
mkdir -p "$src" "$root/DEBIAN" "$root/etc/modprobe.d" "$root/etc/modules-load.d"
# The module sources and their build files; nothing host-specific.
cp "$here"/*.c "$here"/*.h "$here/Makefile" "$here/dkms.conf" \
	"$here/thinvm-balloon.conf" "$src/"
cp "$here/thinvm-balloon.conf" "$root/etc/modprobe.d/thinvm-balloon.conf"
echo thinvm_balloon >"$root/etc/modules-load.d/thinvm-balloon.conf"

sed -e "s/@NAME@/$name/g" -e "s/@VERSION@/$version/g" \
	"$here/debian/control.in" >"$root/DEBIAN/control"
for f in postinst prerm; do
	sed -e "s/@NAME@/$name/g" -e "s/@VERSION@/$version/g" \
		"$here/debian/$f" >"$root/DEBIAN/$f"
	chmod 0755 "$root/DEBIAN/$f"
done
printf '/etc/modprobe.d/thinvm-balloon.conf\n/etc/modules-load.d/thinvm-balloon.conf\n' \
	>"$root/DEBIAN/conffiles"

mkdir -p "$out"
deb=$out/$name-dkms_${version}_all.deb
# Fixed owner and timestamps: the same sources give the same .deb.
find "$root" -exec touch -h -d @0 {} +
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb.tmp" >&2
mv "$deb.tmp" "$deb"
echo "$deb"
