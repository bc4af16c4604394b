#!/usr/bin/env bash
# Run the QEMU qtests that cover thinvm's device and migration changes,
# against the patched build tree.  TAP on stdout; exit status 0 only if
# all passed.
#
#   qemu/run-qtests.sh          every test below, on the patched build
#   qemu/run-qtests.sh --tsan   the sparse-ram migration tests whose
#                               threads meet (postcopy-preempt, multifd) on
#                               the ThreadSanitizer build (qemu/build.sh
#                               tsan), guest under KVM; a test fails if
#                               TSan reports a race with a frame in
#                               sparse-ram's code
#   --match REGEX               only the tests whose path matches (grep -P)
#   --build DIR                 against the build tree DIR (a prefix of
#                               the series, qemu/check-prefixes.sh --qtests)
#   --available                 only the tests below that DIR's binaries
#                               offer: a prefix has the tests of the
#                               patches it holds, and each must pass there
set -uo pipefail

cache=${THINVM_CACHE:-$HOME/.cache/thinvm}
build=$cache/qemu/patched-src/build
venv=${THINVM_VENV:-$cache/venv}
top=$(cd "$(dirname "$0")/.." && pwd)
tsan=0 match= available=0
while [ $# -gt 0 ]; do
	case $1 in
	--tsan) tsan=1 build=$cache/qemu/patched-src/build-tsan ;;
	--match) match=$2; shift ;;
	--build) build=$2; shift ;;
	--available) available=1 ;;
	*) echo "usage: $0 [--tsan] [--match REGEX] [--build DIR] [--available]" >&2; exit 2 ;;
	esac
	shift
done
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
	"qos-test:$qos/pfns/private-file"
	"qos-test:$qos/pfns/read-only-alias"
	"qos-test:$qos/report/private-file"
	"virtio-balloon-test:/x86_64/virtio-balloon/thinvm-machine/defaults"
	"virtio-balloon-test:/x86_64/virtio-balloon/thinvm-machine/q35-unchanged"
	"virtio-balloon-test:/x86_64/virtio-balloon/thinvm-machine/opt-out"
	"virtio-balloon-test:/x86_64/virtio-balloon/thinvm-machine/smbios-product"
	"migration-test:$mig/precopy/unix"
	"migration-test:$mig/precopy/pagemap-read"
	"migration-test:$mig/multifd/tcp"
	"migration-test:$mig/multifd/plain-destination"
	"migration-test:$mig/multifd/mismatched-destination"
	"migration-test:$mig/implied/multifd"
	"migration-test:$mig/implied/property-off"
	"migration-test:$mig/implied/legacy-zero-pages"
	"migration-test:$mig/implied/cancel-and-retry"
	"migration-test:$mig/implied/main"
	"migration-test:$mig/implied/main/built-pages"
	"migration-test:$mig/implied/main/thinvm-machine"
	"migration-test:$mig/implied/main/plain-machine"
	"migration-test:$mig/discarded/precopy"
	"migration-test:$mig/discarded/multifd"
	"migration-test:$mig/discarded/after-send/precopy"
	"migration-test:$mig/discarded/after-send/multifd"
	"migration-test:$mig/file"
	"migration-test:$mig/mapped-ram"
	"migration-test:$mig/mapped-ram/plain-destination"
	"migration-test:$mig/cancel-and-retry"
	"migration-test:$mig/destination-without-capability"
	"migration-test:$mig/refuse/shared-memory"
	"migration-test:$mig/postcopy/plain"
	"migration-test:$mig/postcopy/recovery"
	"migration-test:$mig/postcopy/unsent-pages"
	"migration-test:$mig/postcopy/preempt/plain"
	"migration-test:$mig/postcopy/preempt/recovery"
	"migration-test:$mig/postcopy/dirty/plain"
	"migration-test:$mig/postcopy/dirty/preempt"
	"migration-test:$mig/postcopy/dirty/preempt-recovery"
	"migration-test:$mig/refuse/no-configuration"
	"migration-test:$mig/refuse/mem-prealloc"
	"migration-test:$mig/refuse/mem-lock"
	"migration-test:$mig/with-ignore-shared"
	"migration-test:$mig/fixed-while-loading"
	"migration-test:$mig/tpm-ppi"
)

# Under TSan: the tests where sparse-ram code runs in more than one thread.
if [ $tsan = 1 ]; then
	tests=(
		"migration-test:$mig/postcopy/preempt/plain"
		"migration-test:$mig/postcopy/preempt/recovery"
		"migration-test:$mig/postcopy/dirty/preempt"
		"migration-test:$mig/postcopy/dirty/preempt-recovery"
		"migration-test:$mig/multifd/tcp"
		"migration-test:$mig/discarded/multifd"
	)
fi

if [ -n "$match" ]; then
	selected=()
	for pair in "${tests[@]}"; do
		grep -qP -- "$match" <<<"${pair#*:}" && selected+=("$pair")
	done
	[ ${#selected[@]} -gt 0 ] || { echo "no test matches '$match'" >&2; exit 2; }
	tests=("${selected[@]}")
fi

if [ $available = 1 ]; then
	# Each binary's list once, read in full (grep -q would close the pipe
	# early, and with pipefail the binary's SIGPIPE would read as absent).
	declare -A offered=()
	for bin in qos-test virtio-balloon-test migration-test; do
		[ -x "$build/tests/qtest/$bin" ] &&
			offered[$bin]=$(cd "$build" && QTEST_QEMU_BINARY=./qemu-system-x86_64 \
				"./tests/qtest/$bin" -l 2>/dev/null)
	done
	selected=()
	for pair in "${tests[@]}"; do
		bin=${pair%%:*}
		grep -qxF -- "${pair#*:}" <<<"${offered[$bin]:-}" && selected+=("$pair")
	done
	[ ${#selected[@]} -gt 0 ] || { echo "# no thinvm qtest in $build yet"; exit 0; }
	tests=("${selected[@]}")
fi

for bin in $([ $tsan = 1 ] || echo qos-test virtio-balloon-test) migration-test; do
	[ $available = 1 ] && continue
	[ -x "$build/tests/qtest/$bin" ] || {
		echo "no $bin in $build: run qemu/build.sh patched" >&2
		exit 2
	}
done

# QEMU's migration framework always asks for "-accel kvm -accel tcg".  Where
# thinvm's probe finds KVM slower than TCG (a para-virtualised /dev/kvm),
# run those tests with /dev/kvm hidden so that QEMU falls back to TCG.
# The probe runs from this tree, not from whatever checkout the venv's
# editable install points at: a probe that cannot run must not leave the
# tests on a /dev/kvm that is 2000x slower (minutes of system time each).
hide_kvm=()
accel=
if [ -e /dev/kvm ]; then
	accel=$(PYTHONPATH=$top "$venv/bin/python" -m thinvm.cli accel --build patched) || {
		echo "cannot probe KVM against TCG (thinvm accel): run scripts/setup.sh" >&2
		exit 2
	}
fi
if [ "$accel" = tcg ]; then
	hide_kvm=(unshare --mount)
	[ "$(id -u)" = 0 ] || hide_kvm+=(--map-root-user)
	hide_kvm+=(sh -c 'mount --bind /dev/null /dev/kvm && exec "$@"' hide-kvm)
fi

# TSan writes one log per process; QEMU has reports of its own elsewhere
# (tests/tsan/), so only those that involve sparse-ram fail a test.  The
# test binary is built with TSan too and forks QEMU from a threaded
# process, which TSan refuses unless told that the child only execs.
tsan_logs=
if [ $tsan = 1 ]; then
	tsan_logs=$(mktemp -d)
	trap 'rm -rf "$tsan_logs"' EXIT
	tree=$(sed -n "s/^SRC_PATH=//p" "$build/config-host.mak" 2>/dev/null)
	[ -n "$tree" ] || tree=$cache/qemu/patched-src
	export TSAN_OPTIONS="suppressions=$tree/tests/tsan/suppressions.tsan halt_on_error=0 exitcode=0 die_after_fork=0 log_path=$tsan_logs/tsan"
fi

# Under TCG, TSan's shadow memory for the code buffer and the guest's
# accesses grows by ~150 MB/s until the OOM killer ends QEMU (23 GB
# measured), so the TSan tests run the guest under KVM, however slow it is
# here, and in a memory cgroup (v1 or v2) that keeps a runaway QEMU to
# itself.
tsan_wrap=()
if [ $tsan = 1 ]; then
	[ -w /dev/kvm ] || { echo "--tsan needs /dev/kvm" >&2; exit 2; }
	cg=
	if [ -d /sys/fs/cgroup/memory ]; then
		cg=/sys/fs/cgroup/memory/thinvm-tsan
		mkdir -p "$cg" && echo 8G >"$cg/memory.limit_in_bytes"
	elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
		cg=/sys/fs/cgroup/thinvm-tsan
		mkdir -p "$cg" && echo 8G >"$cg/memory.max"
	fi
	[ -n "$cg" ] && tsan_wrap=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg")
fi

# Print the TSan reports that have a frame in sparse-ram's code.
sparse_races() {
	cat "$tsan_logs"/tsan* 2>/dev/null |
		awk -v RS='==================' '/WARNING: ThreadSanitizer/ &&
			/ram-sparse|ram_sparse_|ram_page_unpopulated/ { print; n++ }
			END { exit n == 0 }'
}

cd "$build" || exit 2
export QTEST_QEMU_BINARY=./qemu-system-x86_64
failed=0
for pair in "${tests[@]}"; do
	bin=${pair%%:*} t=${pair#*:} wrap=()
	[ "$bin" = migration-test ] && wrap=("${hide_kvm[@]}")
	[ $tsan = 1 ] && wrap=("${tsan_wrap[@]}") && rm -f "$tsan_logs"/tsan*
	# One test per process: qos-test honours a single -p.
	if out=$(timeout 600 "${wrap[@]}" "./tests/qtest/$bin" -p "$t" 2>&1) &&
		grep -q "^ok 1 $t\$" <<<"$out" &&
		{ [ $tsan = 0 ] || ! races=$(sparse_races); }; then
		echo "ok - $t"
	else
		echo "not ok - $t"
		sed 's/^/#   /' <<<"$out" | tail -n 20
		[ -n "${races:-}" ] && sed 's/^/#   /' <<<"$races" | head -n 60
		failed=1
	fi
done
exit $failed
