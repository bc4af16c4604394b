#!/usr/bin/env bash
# Work on the QEMU patch series as git commits.
#
#   qemu/dev-tree.sh init     git tree at $THINVM_CACHE/qemu/dev: Debian's
#                             source as the base commit, qemu/series on top
#   qemu/dev-tree.sh export   write the commits above the base back to
#                             qemu/patches and qemu/series
#
# Edit and commit in the dev tree (one topic per commit, Signed-off-by),
# export, then qemu/build.sh patched rebuilds only what changed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
dev=$cache/qemu/dev

die() { printf '[qemu/dev-tree] error: %s\n' "$*" >&2; exit 1; }

init() {
	local pristine
	pristine=$(ls -d "$cache"/qemu/pristine-* 2>/dev/null | tail -n1)
	[ -n "$pristine" ] || die "no pristine source: run qemu/build.sh first"
	[ ! -e "$dev" ] || die "$dev exists; remove it first"
	cp -a "$pristine" "$dev"
	rm -f "$dev/.thinvm-unpacked"
	cd "$dev"
	git init -q
	git config user.name "thinvm developers"
	git config user.email dev@thinvm.invalid
	git add -A >/dev/null
	git commit -qm "Debian $(basename "$pristine") with Debian's patches"
	git tag base
	local p
	while read -r p; do
		case "$p" in ''|'#'*) continue ;; esac
		git am -q "$here/patches/$p" || die "patch $p does not apply"
	done <"$here/series"
	git log --oneline base..HEAD
}

export_series() {
	cd "$dev"
	git rev-parse -q --verify base >/dev/null || die "no 'base' tag in $dev"
	rm -f "$here"/patches/*.patch
	git format-patch -q --no-signature --zero-commit -o "$here/patches" base..HEAD
	# Stable dates keep re-exports from rewriting every patch.
	sed -i 's/^Date: .*/Date: Sat, 21 Nov 2026 17:00:00 +0000/' "$here"/patches/*.patch
	(cd "$here/patches" && ls -- *.patch) >"$here/series"
	cat "$here/series"
}

case "${1:-}" in
init) init ;;
export) export_series ;;
*) echo "usage: $0 init|export" >&2; exit 2 ;;
esac
