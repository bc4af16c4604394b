#!/usr/bin/env bash
# Run the QEMU qtests that cover thinvm's device changes, against the
# patched build tree.  TAP on stdout; exit status 0 only if all passed.
set -uo pipefail

cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
build=$cache/qemu/patched-build
qos=/x86_64/pc/i440FX-pcihost/pci-bus-pc/pci-bus/virtio-balloon-pci/virtio-balloon/virtio-balloon-tests

tests=(
	"$qos/ranges/config"
	"$qos/ranges/inflate"
	"$qos/ranges/deflate"
	"$qos/ranges/invalid"
	"$qos/ranges/not-negotiated"
)

[ -x "$build/tests/qtest/qos-test" ] || {
	echo "no qos-test in $build: run qemu/build.sh patched" >&2
	exit 2
}
cd "$build" || exit 2
export QTEST_QEMU_BINARY=./qemu-system-x86_64
failed=0
for t in "${tests[@]}"; do
	# One test per process: qos-test honours a single -p.
	if out=$(timeout 120 ./tests/qtest/qos-test -p "$t" 2>&1) &&
		grep -q "^ok 1 $t\$" <<<"$out"; then
		echo "ok - $t"
	else
		echo "not ok - $t"
		sed 's/^/#   /' <<<"$out" | tail -n 20
		failed=1
	fi
done
exit $failed
