#!/bin/sh
# Host-side self test for thinvm-mem: a pattern must verify, and must stop
# verifying once a single byte changes.
set -eu

mem=${1:?usage: check-mem.sh PATH-TO-thinvm-mem}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
f=$tmp/pattern

fail() { echo "check-mem: FAIL: $*" >&2; exit 1; }

"$mem" pattern write "$f" 4 --seed 42 >"$tmp/out"
grep -q '"pages":1024' "$tmp/out" || fail "write: $(cat "$tmp/out")"
"$mem" pattern verify "$f" --seed 42 >"$tmp/out" || fail "clean verify"
grep -q '"bad":0,"first_bad":-1' "$tmp/out" || fail "clean: $(cat "$tmp/out")"
if "$mem" pattern verify "$f" --seed 43 >/dev/null; then
	fail "wrong seed verified"
fi
"$mem" pattern corrupt "$f" --page 517 >/dev/null
set +e
"$mem" pattern verify "$f" --seed 42 >"$tmp/out"
rc=$?
set -e
[ $rc -eq 1 ] || fail "corrupt verify exit $rc, want 1"
grep -q '"bad":1,"first_bad":517' "$tmp/out" || fail "corrupt: $(cat "$tmp/out")"
set +e
"$mem" pattern write "$f" 12x --seed 1 2>/dev/null
rc=$?
set -e
[ $rc -eq 2 ] || fail "bad size exit $rc, want 2"
"$mem" touch 8 | grep -q '"touched_mib":8' || fail touch
"$mem" dirty 4 --rate 50 --seconds 1 | grep -q '"pages_written"' || fail dirty
echo "check-mem: ok"
