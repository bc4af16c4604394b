#!/usr/bin/env bash
# All of thinvm's set-up, idempotent and incremental: host packages, the
# Python venv, both QEMU builds and the default guest image.  A warm run
# (nothing changed) takes a few seconds.
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
venv=${THINVM_VENV:-$cache/venv}

# Debian packages thinvm builds and runs with.  qemu-system-data and seabios
# provide the firmware our minimal QEMU build does not install itself;
# libzstd-dev is for multifd-compression=zstd (qemu/build.sh requires it);
# swtpm is the vTPM a sparse-ram qtest migrates.
packages=(
	gcc make patch pkg-config ninja-build ccache rsync flex bison
	libglib2.0-dev libpixman-1-dev zlib1g-dev libzstd-dev
	seabios qemu-system-data ipxe-qemu
	busybox-static cpio kmod zstd xz-utils bc libelf-dev dwarves
	python3-venv strace iproute2
	swtpm
	dpkg-dev
)

log() { printf '[setup] %s\n' "$*" >&2; }

install_packages() {
	local missing=() p
	for p in "${packages[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
			missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return
	log "installing Debian packages: ${missing[*]}"
	if [ "$(id -u)" -ne 0 ]; then
		echo "[setup] error: need root to install ${missing[*]}" >&2
		exit 1
	fi
	apt-get update -q >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
}

# libvirt 11.3 (the first to know QEMU 10) and the disk image's tools come
# from bookworm-backports, through debian-apt.sh's private apt
# configuration (the system's own sources stay untouched).
backports=(libvirt-daemon-system libvirt-clients libvirt-daemon-driver-qemu qemu-utils mmdebstrap)

install_backports() {
	local missing=() p
	for p in "${backports[@]}"; do
		dpkg-query -W -f='${Status} ${Version}' "$p" 2>/dev/null | grep -q 'install ok installed .*bpo12' ||
			missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return
	log "installing from bookworm-backports: ${missing[*]}"
	APT_CONFIG=$cache/apt/etc/apt.conf DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends -t bookworm-backports "${missing[@]}" >&2
}

# The venv is rebuilt only when pyproject.toml changes.
setup_venv() {
	local stamp=$venv/.thinvm-stamp want
	want=$(sha256sum "$top/pyproject.toml" | cut -c1-16)
	if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/thinvm" ]; then
		return
	fi
	log "creating Python venv $venv"
	python3 -m venv "$venv"
	"$venv/bin/pip" install -q --upgrade pip >&2
	# meson >= 1.5 comes from PyPI: Debian 12's is too old for QEMU 10.
	"$venv/bin/pip" install -q 'meson>=1.5' -e "${top}[dev]" >&2
	echo "$want" >"$stamp"
}

# An editable install points at whichever checkout installed it last; make
# sure it is this one.
point_venv_here() {
	local where
	# From /: python would otherwise import ./thinvm and see no difference.
	# A checkout that installed it and was then removed: nothing imports.
	where=$(cd / && "$venv/bin/python3" -c \
		'import thinvm, os; print(os.path.dirname(os.path.dirname(thinvm.__file__)))' \
		2>/dev/null) || where=
	if [ "$where" != "$top" ]; then
		"$venv/bin/pip" install -q --no-deps -e "$top" >&2
	fi
}

mkdir -p "$cache"
install_packages
setup_venv
point_venv_here
"$top/scripts/debian-apt.sh" update
install_backports
"$top/qemu/build.sh" all
# Both builds as libvirt emulators under /usr/local/lib/thinvm (libvirt-qemu
# cannot read /root); refreshed whenever a build changed.
"$venv/bin/thinvm" fleet install >/dev/null
# thinvm's Debian packages and their local apt repository (docs/install.md):
# about 20 s when the QEMU build changed, a second otherwise.
"$top/packaging/build-debs.sh" >/dev/null
# The cached Debian roots of packaged cluster hosts and of the package
# tests (mmdebstrap, 1-2 min each on a fresh machine, instant after): built
# here so that a test's set-up never waits for one.
"$top/packaging/host-root.sh" >/dev/null
"$top/packaging/debian-root.sh" >/dev/null
# Guest images: Debian's in-tree balloon driver and ours, for both kernels.
for kernel in 6.1 6.12; do
	"$top/guest/image/build.sh" --kernel "$kernel" --balloon stock >/dev/null
	ko=$("$top/guest/balloon/build.sh" "$kernel" | tail -n 1)
	"$top/guest/image/build.sh" --kernel "$kernel" --balloon "$ko" >/dev/null
	# The Debian disk image for libvirt guests (docs/fleet.md).
	"$top/guest/image/build-disk.sh" --kernel "$kernel" >/dev/null
done
log "ready: $venv/bin/thinvm"
