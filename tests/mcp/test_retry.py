"""The client's retry of a connect round: the sealed requestState (SECURITY.md C1-C14), the bounded
wait for the browser (DESIGN.md §3.1 step 5) and the flow sweeper (J7).

Every bad state is a JSON-RPC -32602 at HTTP 200 and changes nothing; a good one is answered by
the flow row: completed -> the tool's result, open -> the same URL again after a bounded wait,
ended -> an `isError` result.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import pytest
import time_machine
from sqlalchemy import event, text, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from app.auth.browser import BrowserSessions
from app.auth.principal import McpCaller, Principal
from app.connect import service as flow_service
from app.connect.request_state import RequestStateCodec, arguments_digest
from app.connect.service import purge
from app.crypto import Keyring, generate_key
from app.db import create_engine
from app.models import Flow, FlowStatus

from ..conftest import DEMO_PROVIDER, count_rows, flow_row
from ..support.broker import BrokerProcess, LogWindow
from ..support.clients import Browser, McpHttp, flow_id_from, request_body
from ..support.idp import (
    IdpProcess,
    mint_token,
)
from ..support.schema import validate_response
from ..support.stack import Stack, running_stack, stack_fixture

pytestmark = pytest.mark.both_databases

API_KEY = "sk_CANARYKEY_retry_tests_1"
ARGUMENTS = {"provider": "demo"}
FLOW_TTL_SECONDS = 600  # the broker default; requestState lives as long as its flow
RETRY_WAIT_SECONDS = 3  # BrokerConfig default of the session broker
SLOW_RETRY_WAIT_SECONDS = 15
HOLD_SECONDS = 2.25  # how long the slow broker's retry is watched being held
WAKE_SECONDS = 1.0  # completion to retry answer; measured ~0.1 s, a missed NOTIFY ~1.7 s


def fresh_user(label: str) -> str:
    """A subject of its own, so row counts see only this test (the session DB is shared)."""
    return f"{label}-{secrets.token_hex(4)}"


async def round_one(
    mcp: McpHttp, token: str, arguments: dict[str, Any] | None = None
) -> tuple[dict[str, Any], str, str]:
    """Call connect_account; (InputRequiredResult, input key, flow id)."""
    response = await mcp.call_tool(token, "connect_account", arguments or ARGUMENTS)
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "InputRequiredResult")
    result: dict[str, Any] = body["result"]
    key, flow_id = flow_id_from(result)
    return result, key, flow_id


async def retry(
    mcp: McpHttp,
    token: str,
    state: Any,
    *,
    action: str | None = "accept",
    responses: dict[str, Any] | None = None,
    name: str = "connect_account",
    arguments: dict[str, Any] | None = None,
    capabilities: dict[str, Any] | None = None,
) -> httpx2.Response:
    """The client's retry of the same tools/call with the echoed state and an answer."""
    if responses is None:
        responses = {"connect_demo": {"action": action}} if action else {}
    return await mcp.call_tool(
        token,
        name,
        ARGUMENTS if arguments is None else arguments,
        capabilities=capabilities,
        input_responses=responses,
        request_state=state,
    )


async def finish_in_browser(browser: Browser, user: str, flow_id: str) -> None:
    """The user logs in at the IdP and submits the API-key form of the flow."""
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    submitted = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": API_KEY}
    )
    assert submitted.status_code == 303, submitted.text


def rejection(response: httpx2.Response) -> dict[str, Any]:
    """The JSON-RPC error of a refused retry (asserting the wire shape on the way)."""
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body)
    assert "result" not in body, body
    error: dict[str, Any] = body["error"]
    assert error["code"] == -32602
    return error


def tool_result(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    validate_response(body, "CallToolResult")
    result: dict[str, Any] = body["result"]
    assert result["resultType"] == "complete"
    return result


async def snapshot(db: AsyncEngine, user: str) -> tuple[list[dict[str, Any]], ...]:
    """Every flow and connection row of `user`, for "nothing changed" assertions."""
    tables = []
    async with db.connect() as connection:
        for table in ("flows", "connections"):
            rows = await connection.execute(
                text(f"SELECT * FROM {table} WHERE subject = :s ORDER BY id"), {"s": user}
            )
            tables.append([dict(row) for row in rows.mappings()])
    return tuple(tables)


def codec_with(signing_keys: list[str]) -> RequestStateCodec:
    return RequestStateCodec(Keyring.parse(tuple(signing_keys)), max_age=FLOW_TTL_SECONDS)


def caller_of(issuer: str, user: str, client_id: str = "mcp-client") -> McpCaller:
    return McpCaller(Principal(issuer, user), client_id=client_id, scopes=frozenset())


def forge_state(codec: RequestStateCodec, caller: McpCaller, flow_id: str) -> str:
    """A state with the exact structure the broker issues for a connect round."""
    return codec.issue(
        caller,
        method="tools/call",
        name="connect_account",
        arguments_digest=arguments_digest(ARGUMENTS),
        flow_id=flow_id,
        input_key="connect_demo",
    )


def decode_state(state: str) -> tuple[dict[str, Any], int]:
    """(payload, issue time) of a state (an itsdangerous timestamped token over base64 JSON),
    without the key."""
    payload, stamp, _signature = state.rsplit(".", 2)
    compressed = payload.startswith(".")
    raw = base64.urlsafe_b64decode(payload.lstrip(".") + "=" * (-len(payload.lstrip(".")) % 4))
    document = zlib.decompress(raw) if compressed else raw
    issued = int.from_bytes(base64.urlsafe_b64decode(stamp + "=" * (-len(stamp) % 4)), "big")
    decoded: dict[str, Any] = json.loads(document)
    return decoded, issued


def flip_signature_byte(state: str) -> str:
    """Change the first signature character (the last one may only carry padding bits)."""
    head, signature = state.rsplit(".", 1)
    replacement = "B" if signature[0] != "B" else "C"
    return f"{head}.{replacement}{signature[1:]}"


# ------------------------------------------------------------------------------------------------
# C1-C6, C12-C14: a state that does not verify is refused, changing nothing
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tamper", ["append", "flip"])
async def test_c1_tampered_state_is_refused_without_running_the_tool(
    tamper: str,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    broker: BrokerProcess,
    db: AsyncEngine,
) -> None:
    """C1. MRTR server rule 4 and conformance `input-required-result-tampered-state`: an edited
    state is a JSON-RPC error, never a re-prompt; even on a completed flow no result leaks out."""
    user = fresh_user("c1")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await finish_in_browser(browser, user, flow_id)
    state = result["requestState"]
    forged = state + "-TAMPERED" if tamper == "append" else flip_signature_byte(state)
    before = await snapshot(db, user)
    log = LogWindow(broker)

    response = await retry(mcp, token, forged)

    error = rejection(response)
    assert error["data"] == {"reason": "invalid"}
    assert await snapshot(db, user) == before
    assert (await flow_row(db, flow_id) or {})["status"] == "completed"  # not consumed: no run
    logged = await log.wait_for("request_state.invalid reason=invalid")
    assert "request_state.invalid reason=invalid" in logged
    assert state.rsplit(".", 1)[1] not in logged
    assert forged not in logged
    assert API_KEY not in response.text


async def test_c1_untampered_state_still_works_after_a_tampered_retry(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """C1 control: the refusal did not burn the flow; the genuine state gets the result."""
    user = fresh_user("c1-control")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await finish_in_browser(browser, user, flow_id)
    rejection(await retry(mcp, token, result["requestState"] + "-TAMPERED"))

    response = await retry(mcp, token, result["requestState"])

    assert tool_result(response)["structuredContent"]["status"] == "connected"
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"


async def test_c2_state_signed_with_another_key_is_refused(
    mcp: McpHttp, token_for: Any, idp: IdpProcess, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """C2. Only the broker's signing keys make a state: a well-formed payload under a fresh key
    (even with the broker's key id) is refused as invalid."""
    user = fresh_user("c2")
    token = token_for(user)
    _, _, flow_id = await round_one(mcp, token)
    key_id = broker.config.signing[0].split(":", 1)[0]
    forged = forge_state(codec_with([generate_key(key_id)]), caller_of(idp.issuer, user), flow_id)
    genuine_shape = forge_state(codec_with(broker.config.signing), caller_of(idp.issuer, user), "x")
    before = await snapshot(db, user)

    response = await retry(mcp, token, forged, action="decline")

    assert rejection(response)["data"] == {"reason": "invalid"}
    assert decode_state(forged)[0].keys() == decode_state(genuine_shape)[0].keys()
    assert await snapshot(db, user) == before


async def test_c3_state_older_than_its_ttl_is_refused_as_expired(
    mcp: McpHttp, token_for: Any, idp: IdpProcess, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """C3. A state is verified with max_age = the flow TTL; one second past it the answer is
    -32602 with reason "expired", and a fresh call without state starts over: with a fresh
    state, for the user's link of the same call, still open."""
    user = fresh_user("c3")
    token = token_for(user)
    _, _, flow_id = await round_one(mcp, token)
    codec = codec_with(broker.config.signing)
    with time_machine.travel(time.time() - FLOW_TTL_SECONDS - 1, tick=False):
        expired = forge_state(codec, caller_of(idp.issuer, user), flow_id)
    before = await snapshot(db, user)

    response = await retry(mcp, token, expired)
    fresh, _, fresh_flow = await round_one(mcp, token)

    assert rejection(response)["data"] == {"reason": "expired"}
    assert await flow_row(db, flow_id) == before[0][0]
    assert fresh["resultType"] == "input_required"
    assert fresh_flow == flow_id
    cancelled = await retry(mcp, token, fresh["requestState"], action="cancel")
    assert tool_result(cancelled)["structuredContent"] == {"status": "cancelled"}


async def test_c3_state_just_inside_its_ttl_is_accepted(
    mcp: McpHttp, token_for: Any, idp: IdpProcess, broker: BrokerProcess
) -> None:
    """C3 control: the same forged state issued 30 s before the TTL ends verifies, so the
    expired case above fails for its age alone."""
    user = fresh_user("c3-control")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    codec = codec_with(broker.config.signing)
    with time_machine.travel(time.time() - FLOW_TTL_SECONDS + 30, tick=False):
        aged = forge_state(codec, caller_of(idp.issuer, user), flow_id)

    response = await retry(mcp, token, aged, action=None)

    body = response.json()
    validate_response(body, "InputRequiredResult")
    assert body["result"]["inputRequests"] == result["inputRequests"]


async def test_c4_another_users_state_is_refused_and_reveals_nothing(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """C4. MRTR rule 5 / "State Handle Hijacking": B holding A's state gets -32602; the error
    names neither A nor A's flow, and A's flow is untouched (B even tried to decline it)."""
    alice, bob = fresh_user("c4-alice"), fresh_user("c4-bob")
    result, _, flow_id = await round_one(mcp, token_for(alice))
    before = await flow_row(db, flow_id)

    response = await retry(mcp, token_for(bob), result["requestState"], action="decline")

    error = rejection(response)
    assert error["data"] == {"reason": "principal_mismatch"}
    assert alice not in response.text
    assert flow_id not in response.text
    assert await flow_row(db, flow_id) == before
    assert await count_rows(db, "flows", subject=bob) == 0


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("list_providers", {}),
        ("disconnect_account", ARGUMENTS),
        ("connect_account", {"provider": "demo", "scopes": ["admin"]}),
    ],
    ids=["other-tool", "other-tool-same-arguments", "other-arguments"],
)
async def test_c5_state_reused_on_another_request_is_refused(
    name: str, arguments: dict[str, Any], mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """C5. The state binds the tool name and a digest of the arguments."""
    user = fresh_user("c5")
    token = token_for(user)
    result, _, _ = await round_one(mcp, token)
    before = await snapshot(db, user)

    response = await retry(mcp, token, result["requestState"], name=name, arguments=arguments)

    assert rejection(response)["data"] == {"reason": "request_mismatch"}
    assert await snapshot(db, user) == before


async def test_c6_state_presented_through_another_client_is_refused(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """C6. Elicitation §Security "bind to the client and user identity": the same user's token
    issued to another OAuth client cannot continue the round."""
    user = fresh_user("c6")
    result, _, _ = await round_one(mcp, token_for(user))
    before = await snapshot(db, user)

    response = await retry(mcp, token_for(user, client_id="other-client"), result["requestState"])

    assert rejection(response)["data"] == {"reason": "request_mismatch"}
    assert await snapshot(db, user) == before


async def test_c12_huge_state_is_refused_by_length_before_verifying(
    mcp: McpHttp, token_for: Any, broker: BrokerProcess, db: AsyncEngine
) -> None:
    """C12. A 100 KB state is cut off by the length cap, even one carrying a valid signature
    (so the refusal does not depend on the HMAC check), quickly and without logging the blob."""
    user = fresh_user("c12")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    codec = codec_with(broker.config.signing)
    payload = decode_state(result["requestState"])[0]
    # The codec refuses to issue an oversized state, so sign one with its signer directly.
    signed = codec.sign({**payload, "d": secrets.token_urlsafe(75_000)})
    padded = result["requestState"] + "A" * 100_000
    log = LogWindow(broker)

    started = time.monotonic()
    responses = [await retry(mcp, token, huge) for huge in (signed, padded)]
    elapsed = time.monotonic() - started

    assert len(signed) > 100_000
    for response in responses:
        assert rejection(response)["data"] == {"reason": "invalid"}
    assert elapsed < 2.0
    logged = log.text()
    assert "A" * 64 not in logged
    assert signed[:64] not in logged
    assert (await flow_row(db, flow_id) or {})["status"] == "pending"


@pytest.mark.parametrize("state", [42, None, ["x"], {"v": 1}, ""], ids=repr)
async def test_c13_state_of_the_wrong_type_is_refused(
    state: Any, mcp: McpHttp, token_for: Any
) -> None:
    """C13. `requestState` is a string (schema InputResponseRequestParams); anything else, or an
    empty string, is -32602."""
    token = token_for(fresh_user("c13"))
    body = request_body(
        "tools/call",
        {
            "name": "connect_account",
            "arguments": ARGUMENTS,
            "inputResponses": {"connect_demo": {"action": "accept"}},
            "requestState": state,
        },
    )

    response = await mcp.post(body, token=token)

    assert rejection(response)["data"] == {"reason": "invalid"}


async def test_c14_state_holds_only_a_flow_id_digests_and_a_timestamp(
    mcp: McpHttp, token_for: Any, idp: IdpProcess
) -> None:
    """C14. The state is readable by the client: it carries a keyed digest of the principal, the
    request binding (client id, method, tool, argument digest), the flow id and its issue time;
    never the subject, the issuer, an email address or a secret."""
    user = fresh_user("c14")
    token = token_for(user, extra={"email": f"{user}@example.com"})
    result, key, flow_id = await round_one(mcp, token)

    payload, issued = decode_state(result["requestState"])

    assert set(payload) == {"v", "p", "c", "m", "n", "a", "f", "k"}
    assert payload["v"] == 1
    assert re.fullmatch(r"[0-9a-f]{32}", payload["p"])
    assert payload["a"] == arguments_digest(ARGUMENTS)
    assert (payload["c"], payload["m"], payload["n"]) == (
        "mcp-client",
        "tools/call",
        "connect_account",
    )
    assert (payload["f"], payload["k"]) == (flow_id, key)
    assert abs(issued - time.time()) < 60
    document = json.dumps(payload)
    for secret in (user, idp.issuer, "@", "example.com", API_KEY, token):
        assert secret not in document


# ------------------------------------------------------------------------------------------------
# C7-C11: a good state is answered by the flow row
# ------------------------------------------------------------------------------------------------


async def test_c7_accept_before_the_browser_finished_returns_the_same_url_after_a_bounded_wait(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """C7. DESIGN §3.1 step 5: the retry waits up to retry_wait_seconds, then re-issues the same
    URL with a fresh state; no second flow. The fresh state then finishes the round."""
    user = fresh_user("c7")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)

    started = time.monotonic()
    response = await retry(mcp, token, result["requestState"])
    waited = time.monotonic() - started

    body = response.json()
    validate_response(body, "InputRequiredResult")
    again = body["result"]
    assert again["inputRequests"] == result["inputRequests"]
    assert again["requestState"] != result["requestState"]
    assert RETRY_WAIT_SECONDS - 0.5 <= waited < RETRY_WAIT_SECONDS + 5
    assert await count_rows(db, "flows", subject=user) == 1
    assert (await flow_row(db, flow_id) or {})["status"] == "pending"

    await finish_in_browser(browser, user, flow_id)
    final = await retry(mcp, token, again["requestState"])
    assert tool_result(final)["structuredContent"]["status"] == "connected"


async def test_c7_retry_without_an_answer_re_asks_at_once(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """C7 variant. MRTR: a missing input response is requested again; nothing to wait for."""
    user = fresh_user("c7-noanswer")
    token = token_for(user)
    result, _, _ = await round_one(mcp, token)

    started = time.monotonic()
    response = await retry(mcp, token, result["requestState"], action=None)
    waited = time.monotonic() - started

    body = response.json()
    validate_response(body, "InputRequiredResult")
    assert body["result"]["inputRequests"] == result["inputRequests"]
    assert waited < RETRY_WAIT_SECONDS - 1
    assert await count_rows(db, "flows", subject=user) == 1


@pytest.mark.parametrize("capabilities", [{}, {"elicitation": {}}], ids=["none", "form-only"])
async def test_a_retry_that_does_not_declare_url_elicitation_is_not_asked_the_url_again(
    capabilities: dict[str, Any],
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
    db: AsyncEngine,
) -> None:
    """MRTR rule 7 (spec/DIGEST.md §4.3): only what this request's capabilities declare may be
    asked. A retry of a still-open flow without URL-mode elicitation is -32021 at once (no
    wait), and the flow stays open; once the user has finished, the same retry gets the result,
    which asks nothing."""
    user = fresh_user("c7-no-url")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)

    started = time.monotonic()
    refused = await retry(mcp, token, result["requestState"], capabilities=capabilities)
    waited = time.monotonic() - started

    assert refused.status_code == 400, refused.text
    body = refused.json()
    validate_response(body)
    assert body["error"]["code"] == -32021
    assert body["error"]["data"] == {"requiredCapabilities": {"elicitation": {"url": {}}}}
    assert waited < RETRY_WAIT_SECONDS - 1
    assert (await flow_row(db, flow_id) or {})["status"] == "pending"

    await finish_in_browser(browser, user, flow_id)
    final = await retry(mcp, token, result["requestState"], capabilities=capabilities)
    assert tool_result(final)["structuredContent"]["status"] == "connected"


@pytest.mark.parametrize(
    ("action", "status", "wording"),
    [("decline", "declined", "declined"), ("cancel", "cancelled", "Call the tool again")],
)
async def test_c8_decline_or_cancel_ends_the_flow_with_an_error_result(
    action: str, status: str, wording: str, mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """C8. The model must see the outcome: an `isError` CallToolResult (not a JSON-RPC error),
    the flow ended for good; a later accept on the same state gets the same outcome."""
    user = fresh_user(f"c8-{action}")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)

    response = await retry(mcp, token, result["requestState"], action=action)
    later = await retry(mcp, token, result["requestState"], action="accept")

    ended = tool_result(response)
    assert ended["isError"] is True
    assert wording in ended["content"][0]["text"]
    assert ended["structuredContent"] == {"status": status}
    row = await flow_row(db, flow_id) or {}
    assert row["status"] == status
    assert tool_result(later)["structuredContent"] == {"status": status}
    assert await count_rows(db, "connections", subject=user) == 0


@pytest.mark.parametrize("action", ["decline", "cancel"])
async def test_a_decline_after_the_user_connected_gives_the_final_result(
    action: str, mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """The user finished in the browser before the client's decline or cancel arrived: the
    connection exists, so the retry gets the tool's final result, as the integration API
    answers the same race (tests/integration_api/test_api.py); the flow is consumed."""
    user = fresh_user(f"late-{action}")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await finish_in_browser(browser, user, flow_id)

    response = await retry(mcp, token, result["requestState"], action=action)

    final = tool_result(response)
    assert final.get("isError") is not True
    assert final["structuredContent"]["status"] == "connected"
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"


async def test_c9_retrying_a_completed_round_twice_gives_the_same_result(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """C9. Idempotent retries: the first marks the flow consumed, the second (same state) gets
    the same final result, not a new elicitation and not a second connection."""
    user = fresh_user("c9")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await finish_in_browser(browser, user, flow_id)

    first = await retry(mcp, token, result["requestState"])
    second = await retry(mcp, token, result["requestState"])

    assert tool_result(first) == tool_result(second)
    assert tool_result(first)["structuredContent"]["status"] == "connected"
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"
    assert await count_rows(db, "flows", subject=user) == 1
    assert await count_rows(db, "connections", subject=user) == 1
    assert API_KEY not in first.text + second.text


async def test_c10_credential_removed_after_completion_starts_a_new_flow(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """C10. The completed flow is not proof of a credential: the tool runs again, finds none and
    asks for a new connection with a new flow."""
    user = fresh_user("c10")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await finish_in_browser(browser, user, flow_id)
    async with db.begin() as connection:
        await connection.execute(text("DELETE FROM connections WHERE subject = :s"), {"s": user})

    response = await retry(mcp, token, result["requestState"])

    body = response.json()
    validate_response(body, "InputRequiredResult")
    _, new_flow = flow_id_from(body["result"])
    assert new_flow != flow_id
    assert (await flow_row(db, new_flow) or {})["status"] == "pending"
    assert await count_rows(db, "flows", subject=user) == 2


@pytest.mark.parametrize(
    "responses",
    [
        {"connect_demo": {"action": "maybe"}},
        {"connect_demo": {"content": {}}},
        {"connect_demo": "accept"},
        {"connect_demo": {"action": "accept"}, "unrelated": 7},
        "accept",
        ["accept"],
    ],
    ids=["unknown-action", "no-action", "string-answer", "non-object-extra", "string", "list"],
)
async def test_c11_malformed_input_responses_are_invalid_params(
    responses: Any, mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """C11. An answer that is not an ElicitResult (schema: InputResponses values are objects with
    an `action` enum) is -32602, not a 500 and not a flow change."""
    user = fresh_user("c11")
    token = token_for(user)
    result, _, _ = await round_one(mcp, token)
    before = await snapshot(db, user)

    response = await retry(mcp, token, result["requestState"], responses=responses)

    error = rejection(response)
    assert "inputResponses" in error["message"]
    assert await snapshot(db, user) == before


async def test_c11_unknown_keys_next_to_a_valid_accept_are_ignored(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """C11. Extra response keys and extra fields in the answer do not change the outcome
    (conformance `input-required-result-ignore-extra-params`)."""
    user = fresh_user("c11-extra")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await finish_in_browser(browser, user, flow_id)
    responses = {
        "connect_demo": {"action": "accept", "content": {"x": "y"}, "note": "extra"},
        "unknown_extra_key": {"action": "accept"},
        "another_unexpected": {"action": "decline"},
    }

    response = await retry(mcp, token, result["requestState"], responses=responses)

    assert tool_result(response)["structuredContent"]["status"] == "connected"
    assert (await flow_row(db, flow_id) or {})["status"] == "consumed"


# ------------------------------------------------------------------------------------------------
# The browser side ends the wait: decline button, and a prompt wake on completion
# ------------------------------------------------------------------------------------------------


async def test_decline_on_the_connect_page_gives_the_retry_a_declined_result(
    mcp: McpHttp, token_for: Any, browser: Browser, db: AsyncEngine
) -> None:
    """DESIGN §3.1: the page's "Don't connect" button declines the flow; the client's accept then
    gets the `isError` outcome at once instead of waiting."""
    user = fresh_user("page-decline")
    token = token_for(user)
    result, _, flow_id = await round_one(mcp, token)
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")
    assert 'data-action="decline"' in page.text
    csrf = await browser.csrf_token(f"/connect/{flow_id}")

    declined = await browser.post(f"/connect/{flow_id}/decline", data={"csrf": csrf})
    started = time.monotonic()
    response = await retry(mcp, token, result["requestState"])
    waited = time.monotonic() - started

    assert declined.status_code == 303
    assert declined.headers["location"] == f"/connect/{flow_id}"
    ended = tool_result(response)
    assert ended["isError"] is True
    assert "declined" in ended["content"][0]["text"]
    assert ended["structuredContent"] == {"status": "declined"}
    assert waited < RETRY_WAIT_SECONDS - 1
    assert (await flow_row(db, flow_id) or {})["status"] == "declined"
    assert await count_rows(db, "connections", subject=user) == 0


# a broker with retry_wait_seconds=15 and its own IdP
slow_broker = stack_fixture(
    "slow", retry_wait_seconds=SLOW_RETRY_WAIT_SECONDS, providers={"demo": DEMO_PROVIDER}
)


@pytest.fixture
async def slow_clients(
    slow_broker: Stack,
) -> AsyncIterator[tuple[McpHttp, Browser]]:
    broker = slow_broker.broker
    mcp, browser = McpHttp(broker.mcp_url), Browser(broker.url)
    yield mcp, browser
    await mcp.aclose()
    await browser.aclose()


async def test_a_waiting_retry_returns_as_soon_as_the_browser_completes_the_flow(
    slow_broker: Stack, slow_clients: tuple[McpHttp, Browser]
) -> None:
    """DESIGN §3.1 step 5: the wait is woken by completion (LISTEN/NOTIFY on PostgreSQL, a short
    poll on SQLite), not by the end of retry_wait_seconds."""
    idp, broker = slow_broker.idp, slow_broker.broker
    mcp, browser = slow_clients
    user = fresh_user("wake")
    token = mint_token(idp.signing_jwk, issuer=idp.issuer, audience=broker.mcp_url, subject=user)
    result, _, flow_id = await round_one(mcp, token)
    await browser.login_as(user, next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    started = time.monotonic()
    waiting = asyncio.create_task(retry(mcp, token, result["requestState"]))
    # A bounded negative check, not a pause: the retry must still be held while the flow is open.
    # Holding it just past the first 2 s safety poll of the PostgreSQL waiter means a dead
    # LISTEN connection would only notice the completion at the next poll, ~1.7 s later.
    done, _ = await asyncio.wait({waiting}, timeout=HOLD_SECONDS)
    assert not done, "the retry returned while the flow was still pending"

    submitted_at = time.monotonic()
    submitted = await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": API_KEY}
    )
    response = await asyncio.wait_for(waiting, timeout=SLOW_RETRY_WAIT_SECONDS + 10)
    finished = time.monotonic()

    assert submitted.status_code == 303
    assert tool_result(response)["structuredContent"]["status"] == "connected"
    assert finished - submitted_at < WAKE_SECONDS
    assert finished - started < SLOW_RETRY_WAIT_SECONDS / 3


async def test_a_waiting_retry_sees_a_flow_ended_by_another_process_at_the_next_check(
    slow_broker: Stack, slow_clients: tuple[McpHttp, Browser]
) -> None:
    """A flow ended where no notification reaches this broker (another process on SQLite, a lost
    listener on PostgreSQL): the broker's periodic check of the flows its retries wait for (every
    0.25 s on SQLite, 2 s on PostgreSQL) ends the wait, not retry_wait_seconds."""
    idp, broker = slow_broker.idp, slow_broker.broker
    mcp, _ = slow_clients
    user = fresh_user("ended-elsewhere")
    token = mint_token(idp.signing_jwk, issuer=idp.issuer, audience=broker.mcp_url, subject=user)
    result, _, flow_id = await round_one(mcp, token)
    waiting = asyncio.create_task(retry(mcp, token, result["requestState"]))
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    assert not done, "the retry returned while the flow was still pending"

    engine = create_engine(broker.database_url, pool_size=1)
    try:
        async with engine.begin() as connection:  # a plain UPDATE: no pg_notify
            await connection.execute(
                update(Flow).where(Flow.id == flow_id).values(status=FlowStatus.declined)
            )
    finally:
        await engine.dispose()
    ended_at = time.monotonic()
    response = await asyncio.wait_for(waiting, timeout=SLOW_RETRY_WAIT_SECONDS + 10)
    waited = time.monotonic() - ended_at

    assert tool_result(response)["structuredContent"] == {"status": "declined"}
    assert waited < SLOW_RETRY_WAIT_SECONDS / 3


WAITERS = 12  # retries waiting at once, against a pool of 2 connections (4 with overflow)
AT_ONCE_SECONDS = 2.0  # under the pool's 3 s acquire timeout; answers take milliseconds


async def test_r7_waiting_retries_hold_no_database_connection(workdir: Path) -> None:
    """DESIGN §3.1 step 5, SECURITY R7: a retry waiting for its flow holds no database
    connection. Twelve of them waiting at once against a pool of two leave the database to
    everyone else: another user's round 1 and the readiness check are answered at once, and
    each waiter gets its URL again when its wait ends."""
    with running_stack(
        workdir,
        "r7",
        providers={"demo": DEMO_PROVIDER},
        retry_wait_seconds=4,
        extra={"database": {"pool_size": 2}},
    ) as stack:
        mcp, browser = McpHttp(stack.broker.mcp_url), Browser(stack.broker.url)
        loop = asyncio.get_running_loop()
        try:
            users = [fresh_user("r7") for _ in range(WAITERS)]
            states = [(await round_one(mcp, stack.token(user)))[0] for user in users]
            waiting = [
                asyncio.create_task(retry(mcp, stack.token(user), state["requestState"]))
                for user, state in zip(users, states, strict=True)
            ]
            done, _ = await asyncio.wait(waiting, timeout=1.0)
            assert not done, "a retry returned while its flow was still pending"

            started = loop.time()
            other = await round_one(mcp, stack.token(fresh_user("r7-other")))
            ready = await browser.get("/readyz")
            took = loop.time() - started
            answers = await asyncio.wait_for(asyncio.gather(*waiting), timeout=30)
        finally:
            await mcp.aclose()
            await browser.aclose()

    assert other[2] and ready.status_code == 200
    assert took < AT_ONCE_SECONDS
    for answer, state in zip(answers, states, strict=True):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        validate_response(body, "InputRequiredResult")
        assert flow_id_from(body["result"]) == flow_id_from(state)


# ------------------------------------------------------------------------------------------------
# J7: the sweeper
# ------------------------------------------------------------------------------------------------


def _bulk_flow(subject: str, status: str, expires_at: datetime) -> Flow:
    now = datetime.now(UTC)
    return Flow(
        id=secrets.token_urlsafe(32),
        issuer="http://sweeper.test",
        subject=subject,
        client_id="mcp-client",
        client_name=None,
        audience="mcp",
        provider="demo",
        scopes="",
        tool_name="connect_account",
        args_digest=arguments_digest(ARGUMENTS),
        status=status,
        state_digest=secrets.token_hex(32),
        sealed_pkce_verifier="v1.k.nonce.box",
        created_at=now - timedelta(minutes=20),
        updated_at=now - timedelta(minutes=20),
        expires_at=expires_at,
    )


async def _purge(db: AsyncEngine) -> tuple[int, int]:
    return await purge(async_sessionmaker(db))


async def _statuses(db: AsyncEngine, subject: str) -> dict[str, int]:
    async with db.connect() as connection:
        rows = await connection.execute(
            text(
                "SELECT status, count(*) AS n FROM flows WHERE subject = :s"
                " AND state_digest IS NULL AND sealed_pkce_verifier IS NULL GROUP BY status"
            ),
            {"s": subject},
        )
        return {row.status: int(row.n) for row in rows}


async def test_j7_sweeper_expires_open_flows_past_their_expiry_and_drops_their_secrets(
    unserved_db: AsyncEngine,
) -> None:
    """J7. 1000 open flows past expires_at become `expired` with digest and PKCE verifier nulled;
    a finished flow keeps its status; a day later all of them are deleted."""
    db = unserved_db
    subject = fresh_user("j7-bulk")
    past = datetime.now(UTC) - timedelta(minutes=1)
    flows = [_bulk_flow(subject, FlowStatus.pending, past) for _ in range(1000)]
    flows.append(_bulk_flow(subject, FlowStatus.completed, past))
    async with AsyncSession(db) as session, session.begin():
        session.add_all(flows)

    expired, _ = await _purge(db)

    assert expired == 1000
    assert await _statuses(db, subject) == {FlowStatus.expired: 1000}
    assert await count_rows(db, "flows", subject=subject, status="completed") == 1

    async with db.begin() as connection:
        await connection.execute(
            update(Flow)
            .where(Flow.subject == subject)
            .values(expires_at=datetime.now(UTC) - timedelta(days=2))
        )
    assert await _purge(db) == (0, 1001)
    assert await count_rows(db, "flows", subject=subject) == 0


async def test_j7_sweeper_works_through_a_backlog_in_chunks_of_their_own(
    unserved_db: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """J7 after a flood: a backlog larger than one chunk is worked through in one run, a chunk
    per statement and per transaction, so none of them outlasts the statement timeout or holds
    SQLite's write lock for long."""
    db = unserved_db
    monkeypatch.setattr(flow_service, "PURGE_CHUNK", 10)
    subject = fresh_user("j7-backlog")
    now = datetime.now(UTC)
    async with AsyncSession(db) as session, session.begin():
        session.add_all(
            [_bulk_flow(subject, FlowStatus.pending, now - timedelta(minutes=1)) for _ in range(25)]
        )
    commits: list[Any] = []

    def record(connection: Any) -> None:
        commits.append(connection)

    event.listen(db.sync_engine, "commit", record)
    try:
        expired, _ = await _purge(db)
    finally:
        event.remove(db.sync_engine, "commit", record)
    assert expired == 25
    assert await _statuses(db, subject) == {FlowStatus.expired: 25}
    # 10 + 10 + 5 expired, the lease update, one (empty) delete chunk
    assert len(commits) == 5, commits


async def test_j7_sweeper_statements_are_served_by_indexes(unserved_db: AsyncEngine) -> None:
    """J7 at volume: the sweeper runs every minute over a table holding a day of flows, so none
    of its statements may read a whole table or a whole index. With flows to expire and to
    delete, each statement it sends (the chunk reads and the writes) is explained on the same
    database: SQLite must SEARCH (an index entered by its leading column), never SCAN;
    PostgreSQL, told to avoid sequential scans, must use indexes whose leading column is in the
    index condition (a condition on a later column alone reads the whole index)."""
    db = unserved_db
    subject = fresh_user("j7-plans")
    now = datetime.now(UTC)
    async with AsyncSession(db) as session, session.begin():
        session.add_all(
            [_bulk_flow(subject, FlowStatus.pending, now - timedelta(minutes=1)) for _ in range(3)]
            + [_bulk_flow(subject, FlowStatus.consumed, now - timedelta(days=2)) for _ in range(3)]
        )
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        sent.append((statement, parameters))

    sessions = BrowserSessions(
        Keyring.parse((generate_key("k1"),)), ttl_seconds=600, max_auth_age_seconds=600
    )
    event.listen(db.sync_engine, "before_cursor_execute", record)
    try:
        await purge(async_sessionmaker(db))
        async with AsyncSession(db) as session, session.begin():
            await sessions.purge(session)
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", record)
    writes = [
        (sql, params) for sql, params in sent if sql.lstrip().startswith(("UPDATE", "DELETE"))
    ]
    # expiring (a chunk), the lease update, deleting (a chunk), the login sessions' delete
    assert len(writes) == 4, sent
    assert await count_rows(db, "flows", subject=subject) == 3

    # A chunk's write finds its rows by primary key, not by the chunk's own condition again
    # (which would read the whole backlog for every chunk).
    chunked = [sql for sql, _ in writes if "IN (SELECT" in sql]
    assert len(chunked) == 2, writes
    async with db.begin() as connection:
        if db.dialect.name == "postgresql":
            await connection.exec_driver_sql("SET LOCAL enable_seqscan = off")
            for sql, params in writes:
                plan = await connection.exec_driver_sql("EXPLAIN (FORMAT JSON) " + sql, params)
                document = plan.scalar_one()  # the driver decodes the json column itself
                scans = list(_pg_scans(document[0]["Plan"]))
                assert scans, (sql, plan)
                for node in scans:
                    assert node["Node Type"] != "Seq Scan", (sql, node)
                    leading = await _pg_leading_column(connection, node["Index Name"])
                    assert re.search(rf"\b{leading}\b", node.get("Index Cond", "")), (sql, node)
                if sql in chunked:
                    assert any(node["Index Name"] == "pk_flows" for node in scans), (sql, scans)
        else:
            for sql, params in writes:
                steps = [
                    row[-1]
                    for row in await connection.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)
                    if not row[-1].startswith("LIST SUBQUERY")  # the chunk's ids, not a read
                ]
                assert steps and all(step.startswith("SEARCH ") for step in steps), (sql, steps)
                if sql in chunked:  # the expiry's RETURNING reads the ids from the index alone
                    by_key = re.compile(
                        r"SEARCH flows USING (COVERING )?INDEX sqlite_autoindex_flows_1 \(id=\?\)"
                    )
                    assert any(by_key.fullmatch(step) for step in steps), (sql, steps)


def _pg_scans(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The plan nodes that read a table or an index."""
    if node["Node Type"] == "Seq Scan" or "Index Name" in node:
        yield node
    for child in node.get("Plans", []):
        yield from _pg_scans(child)


async def _pg_leading_column(connection: Any, index: str) -> str:
    return str(
        await connection.scalar(
            text(
                "SELECT a.attname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
                " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]"
                " WHERE c.relname = :name"
            ),
            {"name": index},
        )
    )


async def test_j7_retry_of_a_swept_flow_gets_an_expired_result(
    mcp: McpHttp, token_for: Any, db: AsyncEngine
) -> None:
    """J7 seen from the client: once the sweeper expired (or deleted) the flow, the retry's answer
    is the `isError` "expired" outcome, at once; a flow still inside its TTL is left alone."""
    user = fresh_user("j7-client")
    token = token_for(user)
    calls = {name: {**ARGUMENTS, "scopes": [name]} for name in ("stale", "ancient", "live")}
    stale, _, stale_flow = await round_one(mcp, token, calls["stale"])
    ancient, _, ancient_flow = await round_one(mcp, token, calls["ancient"])
    _, _, live_flow = await round_one(mcp, token, calls["live"])
    now = datetime.now(UTC)
    async with db.begin() as connection:
        for flow_id, expires_at in (
            (stale_flow, now - timedelta(seconds=1)),
            (ancient_flow, now - timedelta(days=1, minutes=1)),
        ):
            await connection.execute(
                update(Flow).where(Flow.id == flow_id).values(expires_at=expires_at)
            )

    await _purge(db)
    answers = [
        await retry(mcp, token, state["requestState"], arguments=calls[name])
        for name, state in (("stale", stale), ("ancient", ancient))
    ]

    assert (await flow_row(db, stale_flow) or {})["status"] == FlowStatus.expired
    assert await flow_row(db, ancient_flow) is None
    assert (await flow_row(db, live_flow) or {})["status"] == FlowStatus.pending
    for answer in answers:
        ended = tool_result(answer)
        assert ended["isError"] is True
        assert ended["structuredContent"] == {"status": "expired"}
