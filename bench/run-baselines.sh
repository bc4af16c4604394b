#!/bin/bash
# Run every benchmark scenario at its default size and regenerate
# docs/benchmarks.md. Migration scenarios measure seven stock and two thinvm
# configurations; stock-best (their baseline) and thinvm are the best of
# each in the same run, legacy stays a reference row; the others run stock
# QEMU and the stock guest driver. Every run waits for a quiet machine (at
# most 10 min) and every variant runs at least 5 times, so a scenario takes
# far longer than it used to on a 2-CPU TCG host; extra arguments (e.g.
# --kernel 6.12) go to every scenario. Scenarios that fail are reported at
# the end; the others still run.
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
