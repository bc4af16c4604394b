#!/bin/bash
# Run every benchmark scenario at its default size and regenerate
# docs/benchmarks.md. Migration scenarios run thinvm against stock-best
# (their baseline) with legacy as a reference row; the others stock QEMU
# and the stock guest driver. Each scenario takes < 5 min on a
# 2-CPU TCG host; extra arguments (e.g. --runs 5, --kernel 6.12) go to every
# scenario. Scenarios that fail are reported at the end; the others still run.
#
#   bench/run-baselines.sh                      # all scenarios
#   SCENARIOS="inflate start" bench/run-baselines.sh --runs 2
set -u
cd "$(dirname "$0")/.."
THINVM=${THINVM:-$HOME/.cache/thinvm/venv/bin/thinvm}
SCENARIOS=${SCENARIOS:-"inflate migrate-idle migrate-dirty migrate-ballooned migrate-scale density density-budget start network save-restore"}

failed=()
for scenario in $SCENARIOS; do
	echo "=== $scenario ($(date -u +%H:%M:%SZ), load $(cut -d' ' -f1-3 /proc/loadavg))"
	start=$(date +%s)
	if ! "$THINVM" bench "$scenario" "$@"; then
		failed+=("$scenario")
	fi
	echo "=== $scenario took $(($(date +%s) - start)) s"
done
if [ ${#failed[@]} -gt 0 ]; then
	echo "failed: ${failed[*]}" >&2
	exit 1
fi
