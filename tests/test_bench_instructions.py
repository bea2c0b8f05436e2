"""bench/instructions.py's driver: what runs under callgrind sends every request and checks every
answer, so a count is never taken of requests that failed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.echo_app import app as bare
from bench.instructions import COLLECTED, WARMUP, _drive, _rounds

REQUESTS = [("cbs_x", "/api/v1/credentials/demo?issuer=i&subject=s")]


@pytest.mark.parametrize("concurrency", [1, 3, 32])
async def test_every_request_is_sent_and_answered_at_most_concurrency_at_once(
    concurrency: int,
) -> None:
    requests = [(f"cbs_{n}", f"/api/v1/credentials/demo?issuer=i&subject=s{n}") for n in range(5)]
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
