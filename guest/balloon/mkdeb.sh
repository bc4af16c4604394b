#!/usr/bin/env bash
# SPDX-License-Identifier: GPL-2.0
#
# Copy thinvm-balloon-dkms_<version>_all.deb into OUTDIR: the driver's
# source under /usr/src for DKMS, plus the modprobe.d blacklist of the
# in-tree virtio_balloon and a modules-load.d entry for thinvm_balloon.
# packaging/build-debs.sh builds it (packaging/thinvm-balloon-dkms/), with
# thinvm's other packages.  This is how a user installs the driver on a
# Debian guest:
#
#   apt-get install ./thinvm-balloon-dkms_*_all.deb
#
# The postinst builds and installs the module for every installed kernel
# that has headers; DKMS' own kernel hooks cover kernels installed later.
#
# Usage: mkdeb.sh OUTDIR     (prints the .deb path on the last line)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:?usage: mkdeb.sh OUTDIR}

deb=$("$here/../../packaging/build-debs.sh" thinvm-balloon-dkms | tail -n 1)
mkdir -p "$out"
cp "$deb" "$out/"
echo "$out/$(basename "$deb")"
