#!/usr/bin/env bash
# Run a command, then print the CPU time the whole machine spent meanwhile (user + nice + system,
# from /proc/stat) beside the wall time. Unlike `time`, it also counts processes the command did
# not wait for itself, such as the test brokers forked by a fork server (tests/support/forked.py).
# Usage: bash scripts/machine_cpu.sh bash scripts/test.sh
set -uo pipefail
ticks() { awk '/^cpu /{print $2 + $3 + $4}' /proc/stat; }
hz="$(getconf CLK_TCK)"
before="$(ticks)"
started="$(date +%s.%N)"
"$@"
status=$?
after="$(ticks)"
ended="$(date +%s.%N)"
awk -v t="$((after - before))" -v hz="$hz" -v s="$started" -v e="$ended" \
  'BEGIN { printf "machine CPU %.1f s, wall %.1f s\n", t / hz, e - s }' >&2
exit "$status"
