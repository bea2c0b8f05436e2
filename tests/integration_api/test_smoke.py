"""The integration API's main path: a sibling requires a credential, the user connects, resume."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from ..support.broker import BrokerProcess, cli
from ..support.clients import URL_CAPS, Browser
from ..support.http import local_client

pytestmark = pytest.mark.both_databases


def create_service(broker: BrokerProcess, name: str, *args: str) -> str:
    result = cli("service", "create", name, *args, config_path=broker.config_path)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


async def test_sibling_gets_an_elicitation_then_the_credential(
    broker: BrokerProcess, browser: Browser, idp: Any
) -> None:
    secret = create_service(broker, "smoke-sibling")
    user = {"issuer": idp.issuer, "subject": "api-smoke"}
    api = local_client(
        base_url=f"{broker.url}/api/v1",
        headers={"Authorization": f"Bearer {secret}"},
    )
    body = {
        "user": user,
        "client_capabilities": URL_CAPS,
        "client_name": "Claude",
        "request_digest": "call-1",
    }

    first = (await api.post("/connections/demo/require", json=body)).json()
    flow_id = first["inputRequests"]["connect_demo"]["params"]["url"].rsplit("/", 1)[1]
    await browser.login_as("api-smoke", next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": "sk_CANARYKEY_sibling"}
    )
    resumed = (
        await api.post(
            "/connections/demo/resume",
            json={
                **body,
                "request_state": first["requestState"],
                "input_response": {"action": "accept"},
            },
        )
    ).json()
    fetched = await api.get("/credentials/demo", params=user)
    anonymous = await api.get(
        "/credentials/demo", params=user, headers={"Authorization": "Bearer cbs_wrong"}
    )
    await api.aclose()

    assert first["status"] == "input_required"
    assert "<strong>smoke-sibling</strong> (via a client that calls itself “Claude”)" in page.text
    assert resumed["status"] == "connected"
    assert resumed["credential"]["secret"] == "sk_CANARYKEY_sibling"
    assert fetched.json()["secret"] == "sk_CANARYKEY_sibling"
    assert anonymous.status_code == 401
    assert anonymous.headers["content-type"] == "application/problem+json"


async def test_many_concurrent_credential_fetches_all_succeed(
    broker: BrokerProcess, browser: Browser, idp: Any
) -> None:
    """A request never holds one pooled connection while waiting for a second one, so more
    concurrent requests than the pool has connections still all succeed."""
    secret = create_service(broker, "smoke-concurrent")
    user = {"issuer": idp.issuer, "subject": "api-concurrent"}
    api = local_client(
        base_url=f"{broker.url}/api/v1",
        timeout=30,
        headers={"Authorization": f"Bearer {secret}"},
    )
    body = {"user": user, "client_capabilities": URL_CAPS, "request_digest": "c"}
    first = (await api.post("/connections/demo/require", json=body)).json()
    flow_id = first["inputRequests"]["connect_demo"]["params"]["url"].rsplit("/", 1)[1]
    await browser.login_as("api-concurrent", next_path=f"/connect/{flow_id}")
    csrf = await browser.csrf_token(f"/connect/{flow_id}")
    await browser.post(
        f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": "sk_CANARYKEY_concurrent"}
    )

    answers = await asyncio.gather(*(api.get("/credentials/demo", params=user) for _ in range(48)))
    await api.aclose()

    assert [answer.status_code for answer in answers] == [200] * 48
