#!/usr/bin/env bash
# Run the QEMU qtests that cover thinvm's device and migration changes,
# against the patched build tree.  TAP on stdout; exit status 0 only if
# all passed.
set -uo pipefail

cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
build=$cache/qemu/patched-build
venv=${THINVM_VENV:-$cache/venv}
qos=/x86_64/pc/i440FX-pcihost/pci-bus-pc/pci-bus/virtio-balloon-pci/virtio-balloon/virtio-balloon-tests

mig=/x86_64/migration/sparse-ram

# binary:path pairs
tests=(
	"qos-test:$qos/ranges/config"
	"qos-test:$qos/ranges/inflate"
	"qos-test:$qos/ranges/deflate"
	"qos-test:$qos/ranges/invalid"
	"qos-test:$qos/ranges/not-negotiated"
	"qos-test:$qos/ranges/invalid-order"
	"qos-test:$qos/ranges/empty"
	"qos-test:$qos/ranges/read-only-alias"
	"qos-test:$qos/ranges/private-file"
	"qos-test:$qos/ranges/numa-granule"
	"qos-test:$qos/ranges/discard-failure"
	"migration-test:$mig/precopy/unix"
	"migration-test:$mig/precopy/pagemap-read"
	"migration-test:$mig/multifd/tcp"
	"migration-test:$mig/discarded/precopy"
	"migration-test:$mig/discarded/multifd"
	"migration-test:$mig/file"
	"migration-test:$mig/mapped-ram"
	"migration-test:$mig/cancel-and-retry"
	"migration-test:$mig/destination-without-capability"
	"migration-test:$mig/refuse/shared-memory"
	"migration-test:$mig/postcopy/plain"
	"migration-test:$mig/postcopy/recovery"
	"migration-test:$mig/postcopy/unsent-pages"
	"migration-test:$mig/refuse/no-configuration"
	"migration-test:$mig/refuse/mem-prealloc"
	"migration-test:$mig/refuse/mem-lock"
	"migration-test:$mig/with-ignore-shared"
	"migration-test:$mig/tpm-ppi"
)

for bin in qos-test migration-test; do
	[ -x "$build/tests/qtest/$bin" ] || {
		echo "no $bin in $build: run qemu/build.sh patched" >&2
		exit 2
	}
done

# QEMU's migration framework always asks for "-accel kvm -accel tcg".  Where
# thinvm's probe finds KVM slower than TCG (a para-virtualised /dev/kvm),
# run those tests with /dev/kvm hidden so that QEMU falls back to TCG.
hide_kvm=()
if [ -e /dev/kvm ] &&
	[ "$("$venv/bin/thinvm" accel --build patched 2>/dev/null)" = tcg ]; then
	hide_kvm=(unshare --mount)
	[ "$(id -u)" = 0 ] || hide_kvm+=(--map-root-user)
	hide_kvm+=(sh -c 'mount --bind /dev/null /dev/kvm && exec "$@"' hide-kvm)
fi

cd "$build" || exit 2
export QTEST_QEMU_BINARY=./qemu-system-x86_64
failed=0
for pair in "${tests[@]}"; do
	bin=${pair%%:*} t=${pair#*:} wrap=()
	[ "$bin" = migration-test ] && wrap=("${hide_kvm[@]}")
	# One test per process: qos-test honours a single -p.
	if out=$(timeout 300 "${wrap[@]}" "./tests/qtest/$bin" -p "$t" 2>&1) &&
		grep -q "^ok 1 $t\$" <<<"$out"; then
		echo "ok - $t"
	else
		echo "not ok - $t"
		sed 's/^/#   /' <<<"$out" | tail -n 20
		failed=1
	fi
done
exit $failed
