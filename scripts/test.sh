#!/usr/bin/env bash
# Install everything the test suite needs, then, at the same time: every test on SQLite, the
# tests marked both_databases on PostgreSQL, and the linters. Fails if any of the three fails.
# Usage: bash scripts/test.sh [extra pytest args]   (docs/testing.md)
# BROKER_TEST_SKIP_INSTALL=1 skips the apt, pip and npm steps.
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
  local need_apt=()
  command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
  command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
  command -v pg_isready >/dev/null 2>&1 || need_apt+=(postgresql-client)
  if [ ${#need_apt[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
  fi

  # the two npm installs run beside pip's (each waits on the network or the disk, not the CPU)
  local npm_pids=()
  npm ci --prefix tests/idp --no-audit --no-fund --loglevel=error &
  npm_pids+=("$!")
  npm ci --prefix tests/conformance --no-audit --no-fund --loglevel=error &
  npm_pids+=("$!")
  python3 -m pip install -q --disable-pip-version-check -e ".[test]" -e ./clients/python
  for pid in "${npm_pids[@]}"; do
    wait "$pid"
  done
}

if [ "${BROKER_TEST_SKIP_INSTALL:-0}" != 1 ]; then
  install
fi

if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi

# A marker expression among the extra arguments is combined with PostgreSQL's own selection
# (pytest keeps only the last -m); every other argument goes to both runs unchanged.
marker=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m) marker="$2"; shift 2 ;;
    -m=*) marker="${1#-m=}"; shift ;;
    -m*) marker="${1#-m}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
sqlite_marker=()
pg_marker=(-m both_databases)
if [ -n "$marker" ]; then
  sqlite_marker=(-m "$marker")
  pg_marker=(-m "both_databases and ($marker)")
fi

export BROKER_TEST_ARTIFACTS="${BROKER_TEST_ARTIFACTS:-$PWD/test-artifacts}"
# Every broker, replica and CLI call the tests start imports the app's ~110 modules; without
# cached bytecode each start compiles them all again.
unset PYTHONDONTWRITEBYTECODE
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
# Two workers per run, one test file each at a time (a module's stack stays on one worker), the
# files in the order tests/conftest.py gives them (the long ones first).
pytest=(python3 -m pytest -p no:benchmark -n 2 --dist loadfile --no-loadscope-reorder --durations=15)

part() {  # part NAME COMMAND...: run in the background, output to $logs/NAME.log
  local name="$1"
  shift
  (
    started=$SECONDS
    status=0
    "$@" >"$logs/$name.log" 2>&1 || status=$?
    echo "[$name: exit $status after $((SECONDS - started)) s]" >>"$logs/$name.log"
    exit "$status"
  ) &
  pids+=("$!")
  names+=("$name")
}

# mypy keeps its cache outside the checkout, so a fresh clone on a machine that ran the suite before
# checks only what changed (it compares the files' hashes, not their paths or times): about 17 s of
# CPU for the whole tree, under a second after.
MYPY_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/connect-broker/mypy"

lint() {
  ruff check . && ruff format --check . &&
    mypy --strict --cache-dir "$MYPY_CACHE" app connect_broker_client tests bench examples migrations &&
    lint-imports
}

pids=()
names=()
part sqlite env BROKER_TEST_DB=sqlite "${pytest[@]}" "${sqlite_marker[@]}" "${args[@]}"
part postgresql env BROKER_TEST_DB=postgresql "${pytest[@]}" "${pg_marker[@]}" "${args[@]}"
part lint lint

failed=()
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || failed+=("${names[$i]}")
done
for name in "${names[@]}"; do
  echo "==================== $name ===================="
  cat "$logs/$name.log"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "All parts passed: ${names[*]}"
