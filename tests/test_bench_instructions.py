"""bench/instructions.py's driver: what runs under callgrind sends every request and checks every
answer, so a count is never taken of requests that failed. The whole run, with --user-proof,
is driven through a stand-in for valgrind that runs the child as is: every side's requests,
the token exchanges included, reach a real broker app and a real IdP's keys."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest

from bench import instructions
from bench.echo_app import app as bare
from bench.instructions import COLLECTED, WARMUP, _drive, _request, _rounds, write_token_pool

REQUESTS = [("cbs_x", "/api/v1/credentials/demo?issuer=i&subject=s", "")]
PER_REQUEST = 7  # the stand-in's instructions per measured request
# Runs the child without valgrind's options, then reports PER_REQUEST per measured request in
# callgrind's summary line, or nothing if the child failed.
STAND_IN = f"""#!{sys.executable}
import subprocess, sys
command = [arg for arg in sys.argv[1:] if not arg.startswith("--callgrind-out-file")]
command = command[command.index("--tool=callgrind") + 1 :]
measured = int(command[command.index("--measured") + 1])
done = subprocess.run(command)
if done.returncode == 0:
    print(f"==1== Collected : {{1000 + {PER_REQUEST} * measured}}", file=sys.stderr)
sys.exit(done.returncode)
"""


@pytest.mark.parametrize("concurrency", [1, 3, 32])
async def test_every_request_is_sent_and_answered_at_most_concurrency_at_once(
    concurrency: int,
) -> None:
    requests = [
        (f"cbs_{n}", f"/api/v1/credentials/demo?issuer=i&subject=s{n}", "") for n in range(5)
    ]
    seen: list[str] = []
    in_flight, most = 0, 0

    async def counting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal in_flight, most
        seen.append(scope["query_string"].decode())
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0)
        await bare(scope, receive, send)
        in_flight -= 1

    assert await _drive(counting, "127.0.0.1", requests, 7, concurrency) == 0
    assert seen == [f"issuer=i&subject=s{n % 5}" for n in range(WARMUP + 7)]
    assert most == concurrency


def test_the_warm_up_rounds_are_the_same_with_and_without_measured_requests() -> None:
    assert _rounds(0, 70, 32) == [(0, 32), (32, 32), (64, 6)]
    assert _rounds(70, 33, 32) == [(70, 32), (102, 1)]
    assert _rounds(70, 0, 32) == []


@pytest.mark.parametrize(("status", "body"), [(401, b'{"secret":"sk_x"}'), (200, b"{}")])
async def test_a_refused_or_keyless_answer_fails_the_run(
    status: int, body: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    async def answer(_scope: dict[str, Any], _receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    assert await _drive(answer, "127.0.0.1", REQUESTS, 3, 4) == 1
    assert f"answered {status}" in capsys.readouterr().err


def test_the_count_is_read_from_callgrinds_summary() -> None:
    summary = (
        "==12== Events    : Ir\n"
        "==12== Collected : 4862536509\n"
        "==12== \n"
        "==12== I   refs:      4,862,536,509\n"
    )
    found = COLLECTED.search(summary)
    assert found is not None and int(found.group(1)) == 4862536509


async def test_a_token_pool_line_is_posted_as_a_form(tmp_path: Path) -> None:
    """write_token_pool's lines become POSTs of the RFC 8693 form, with its media type."""
    pool = write_token_pool(tmp_path / "pool.txt", "cbs_p", ["tok.en.one", "tok.en.two"])
    requests = [_request(line) for line in pool.read_text().splitlines()]
    seen: list[tuple[str, str, dict[str, list[str]]]] = []

    async def answering(scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        headers = dict(scope["headers"])
        assert headers[b"content-type"] == b"application/x-www-form-urlencoded"
        assert int(headers[b"content-length"]) == len(message["body"])
        assert headers[b"authorization"] == b"Bearer cbs_p"
        seen.append((scope["method"], scope["path"], parse_qs(message["body"].decode())))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"access_token":"sk_bench_1"}'})

    assert await _drive(answering, "127.0.0.1", requests, 0, 4) == 0
    assert {(method, path) for method, path, _ in seen} == {("POST", "/api/v1/token")}
    assert [form["subject_token"] for _, _, form in seen[:2]] == [["tok.en.one"], ["tok.en.two"]]
    assert seen[0][2]["requested_token_type"] == ["urn:connect-broker:credential:demo"]


def test_the_user_proof_run_counts_every_side_through_real_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--user-proof`: the GET, the bare route and both token exchanges (a known token, a new
    one) each answered 200 with the stored key in every run; each side reports its count."""
    stand_in = tmp_path / "bin" / "valgrind"
    stand_in.parent.mkdir()
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stand_in.parent}:{os.environ['PATH']}")

    assert instructions.main(["--user-proof", "--requests", "40", "--concurrency", "8"]) == 0

    printed = capsys.readouterr().out
    for label in instructions.SIDES.values():
        assert f"  {label:<33} {PER_REQUEST:>9,.0f}" in printed, printed
    assert "ratio 1.000x" in printed
