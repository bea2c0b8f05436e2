"""The integration API's part of L4, L6 and L8: a relayed client name is neutralised and shown as
the client's own claim after the registered service; scope arguments are single scopes; every
answer that carries a credential says `Cache-Control: no-store`, on both credential paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.config import load_settings

from ..conftest import count_rows
from ..support.broker import BrokerProcess
from ..support.clients import Browser
from ..support.idp import IdpProcess
from .test_api import (
    API_KEY,
    Registered,
    ServiceApi,
    connected,
    fresh_name,
    fresh_user,
    input_required,
    problem,
    register,
    submit_api_key,
)

pytestmark = pytest.mark.both_databases


@pytest.fixture(scope="module")
def service(broker: BrokerProcess) -> Registered:
    return register(broker, fresh_name("hardening"))


@pytest.fixture
async def api(broker: BrokerProcess, service: Registered) -> Any:
    client = ServiceApi(broker.url, service)
    yield client
    await client.aclose()


@pytest.fixture
def user_of(idp: IdpProcess) -> Any:
    def make(label: str) -> dict[str, str]:
        return {"issuer": idp.issuer, "subject": fresh_user(label)}

    return make


async def test_L4_sibling_client_name_is_neutralised_and_labelled(
    api: ServiceApi, browser: Browser, user_of: Any, db: AsyncEngine
) -> None:
    """L4/L6. The relayed `client_name` is the MCP client's self-description: its bidi controls
    are shown, and the page leads with the registered service, the client's name as its own."""
    user = user_of("l4-sibling")

    _, flow_id = input_required(await api.require("demo", user, client_name="Cla\u202eude"))
    await browser.login_as(user["subject"], next_path=f"/connect/{flow_id}")
    page = await browser.get(f"/connect/{flow_id}")

    assert "\u202e" not in page.text
    assert (
        f"<strong>{api.name}</strong> (via a client that calls itself “Cla[U+202E]ude”) asks"
        in page.text
    )
    assert await count_rows(db, "flows", client_name=f"{api.name} (via Cla[U+202E]ude)") == 1


def test_L4_configured_names_are_neutralised(tmp_path: Path) -> None:
    """L4. Names from the configuration reach pages too (a sibling's and a provider's)."""
    path = tmp_path / "broker.toml"
    path.write_text(
        '[services.beta]\ndisplay_name = "Beta\\u202e Tools"\n'
        '[providers.keyed]\nkind = "api_key"\ndisplay_name = "Key\\u200bed"\n'
        'label = "Token\\u2066"\n',
        encoding="utf-8",
    )

    settings = load_settings(path, environ={})

    assert settings.service_display_name("beta") == "Beta[U+202E] Tools"
    keyed = settings.providers["keyed"]
    assert (keyed.display_name, getattr(keyed, "label", None)) == ("Key[U+200B]ed", "Token[U+2066]")


async def test_L6_a_scope_holding_a_separator_is_refused_by_the_api(
    api: ServiceApi, user_of: Any, db: AsyncEngine
) -> None:
    """L6. `scopes` entries are single scope tokens: 422 naming the entry, no flow."""
    user = user_of("l6-api")

    refused = await api.require("github", user, scopes=["repo", "read:org user"])

    body = problem(refused, 422, "invalid_request")
    assert [error["loc"] for error in body["errors"]] == [["body", "scopes", 1]]
    assert await count_rows(db, "flows", subject=user["subject"]) == 0


async def test_L8_every_answer_carrying_a_credential_is_no_store(
    api: ServiceApi, browser: Browser, user_of: Any
) -> None:
    """L8. A credential must not be kept by a cache on the way: the credential fetch (whatever
    the order of its query) and the connected answers of `require` and `resume`."""
    user = user_of("l8")
    first, flow_id = input_required(await api.require("demo", user))
    assert "no-store" not in (await api.require("demo", user)).headers.get("cache-control", "")
    await submit_api_key(browser, user["subject"], flow_id)

    resumed = await api.resume("demo", user, first["requestState"])
    required = await api.require("demo", user)
    fast = await api.credential("demo", user)
    reordered = {"subject": user["subject"], "issuer": user["issuer"]}
    routed = await api.http.get("/credentials/demo", params=reordered)

    assert connected(resumed)["secret"] == API_KEY
    assert connected(required)["secret"] == API_KEY
    for answer in (resumed, required, fast, routed):
        assert answer.status_code == 200, answer.text
        assert answer.headers["cache-control"] == "no-store"
    assert fast.json() == routed.json()
