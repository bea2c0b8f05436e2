"""bench/instructions.py's driver: what runs under callgrind sends every request and checks every
answer, so a count is never taken of requests that failed."""

from __future__ import annotations

from typing import Any

import pytest

from bench.echo_app import app as bare
from bench.instructions import COLLECTED, WARMUP, _drive

REQUESTS = [("cbs_x", "/api/v1/credentials/demo?issuer=i&subject=s")]


async def test_every_request_is_sent_and_answered() -> None:
    seen: list[str] = []

    async def counting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["query_string"].decode())
        await bare(scope, receive, send)

    assert await _drive(counting, "127.0.0.1", REQUESTS, 7) == 0
    assert seen == ["issuer=i&subject=s"] * (WARMUP + 7)


@pytest.mark.parametrize(("status", "body"), [(401, b'{"secret":"sk_x"}'), (200, b"{}")])
async def test_a_refused_or_keyless_answer_fails_the_run(
    status: int, body: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    async def answer(_scope: dict[str, Any], _receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    assert await _drive(answer, "127.0.0.1", REQUESTS, 3) == 1
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
