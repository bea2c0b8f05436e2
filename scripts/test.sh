#!/usr/bin/env bash
# Install everything the test suite needs, then run it on SQLite and on PostgreSQL, then lint.
# Usage: bash scripts/test.sh [extra pytest args]
# BROKER_TEST_SKIP_INSTALL=1 skips the apt, pip and npm steps (see docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."

install() {
need_apt=()
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
command -v pg_isready >/dev/null 2>&1 || need_apt+=(postgresql-client)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

python3 -m pip install -q --disable-pip-version-check -e ".[test]" -e ./clients/python
npm ci --prefix tests/idp --no-audit --no-fund --loglevel=error
npm ci --prefix tests/conformance --no-audit --no-fund --loglevel=error
}

if [ "${BROKER_TEST_SKIP_INSTALL:-0}" != 1 ]; then
  install
fi

if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi

export BROKER_TEST_ARTIFACTS="${BROKER_TEST_ARTIFACTS:-$PWD/test-artifacts}"
BROKER_TEST_DB=sqlite python3 -m pytest "$@"
BROKER_TEST_DB=postgresql python3 -m pytest "$@"

ruff check .
ruff format --check .
mypy --strict app connect_broker_client tests bench examples migrations
