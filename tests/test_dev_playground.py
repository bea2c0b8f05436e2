"""`connect-broker dev`: the loopback playground with its development IdP, end to end over HTTP."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from .connect.test_pages import assert_security_headers
from .support.broker import BrokerProcess
from .support.clients import Browser, McpHttp, flow_id_from
from .support.http import local_client
from .support.idp import free_port
from .support.playground import cli, running_dev


@pytest.fixture(scope="module")
def playground(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    cwd = tmp_path_factory.mktemp("dev")
    with running_dev(cwd, free_port()) as (url, _log):
        yield url, cwd


def dev_token(cwd: Path, user: str) -> str:
    result = cli(cwd, "dev-token", user)
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_dev_token_prints_one_line_that_the_playground_accepts(
    playground: tuple[str, Path],
) -> None:
    url, cwd = playground
    output = dev_token(cwd, "alice")
    mcp = McpHttp(f"{url}/mcp")

    response = await mcp.call_tool(output.strip(), "connect_account", {"provider": "demo"})
    await mcp.aclose()

    assert output.count("\n") == 1 and output.endswith("\n")
    assert response.json()["result"]["resultType"] == "input_required"
    assert (cwd / "data" / "dev.json").stat().st_mode & 0o777 == 0o600
    assert (cwd / "data" / "dev-idp-key.json").stat().st_mode & 0o777 == 0o600


async def test_dev_playground_connects_the_demo_provider_end_to_end(
    playground: tuple[str, Path],
) -> None:
    """The README's first run: token → elicitation → dev login as alice → API key → retry."""
    url, cwd = playground
    token = dev_token(cwd, "alice").strip()
    mcp, browser = McpHttp(f"{url}/mcp"), Browser(url)
    first = (await mcp.call_tool(token, "connect_account", {"provider": "demo"})).json()["result"]
    key, flow_id = flow_id_from(first)

    to_login = await browser.get(f"/connect/{flow_id}")
    to_idp = await browser.get(to_login.headers["location"])
    form = await browser.http.get(to_idp.headers["location"])
    fields = dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form.text))
    back = await browser.http.post(f"{url}/dev-idp/authorize", data={**fields, "username": "alice"})
    callback = urlsplit(back.headers["location"])
    landed = await browser.get(f"{callback.path}?{callback.query}")
    csrf = await browser.csrf_token(landed.headers["location"])
    await browser.post(f"/connect/{flow_id}/api-key", data={"csrf": csrf, "api_key": "demo_abc123"})
    retry = await mcp.call_tool(
        token,
        "connect_account",
        {"provider": "demo"},
        input_responses={key: {"action": "accept"}},
        request_state=first["requestState"],
    )
    await mcp.aclose()
    await browser.aclose()

    assert "DEVELOPMENT IDENTITY PROVIDER" in form.text
    assert back.status_code == 303  # the code and state in Location: never cached nor referred
    assert (back.headers["cache-control"], back.headers["referrer-policy"]) == (
        "no-store",
        "no-referrer",
    )
    assert landed.headers["location"] == f"/connect/{flow_id}"
    assert retry.json()["result"]["structuredContent"]["status"] == "connected"


async def test_serve_never_exposes_the_development_idp(broker: BrokerProcess) -> None:
    """The dev IdP is mounted only by the `dev` command; no setting enables it."""
    async with local_client() as http:
        for path in (
            "/dev-idp/.well-known/openid-configuration",
            "/dev-idp/authorize",
            "/dev-idp/jwks",
        ):
            assert (await http.get(f"{broker.url}{path}")).status_code == 404


async def test_a_development_sign_in_form_that_cannot_be_read_gets_the_error_page(
    playground: tuple[str, Path],
) -> None:
    """Starlette refuses a form with too many fields before the route runs: the answer is the
    error page with its security headers and a next step, not `{"detail": …}` JSON."""
    url, _ = playground
    fields = {f"f{index}": "x" for index in range(17)}
    async with local_client() as http:
        response = await http.post(f"{url}/dev-idp/authorize", data=fields)

    assert response.status_code == 400
    assert_security_headers("POST /dev-idp/authorize", response)
    assert "This request could not be read" in response.text
    assert "reload the page and try again" in response.text


@pytest.mark.parametrize("credentials", ["/w==", "not base64!"], ids=["not-utf-8", "not-base64"])
async def test_development_token_endpoint_answers_unreadable_basic_credentials_as_invalid_client(
    credentials: str, playground: tuple[str, Path]
) -> None:
    """RFC 6749 §5.2: client authentication failed, so 401 `invalid_client` naming the scheme
    (bytes that are not UTF-8 text used to end in a 500)."""
    url, _ = playground
    async with local_client() as http:
        response = await http.post(
            f"{url}/dev-idp/token",
            data={"grant_type": "authorization_code", "code": "x"},
            headers={"Authorization": f"Basic {credentials}"},
        )

    assert response.status_code == 401
    assert response.json() == {"error": "invalid_client"}
    assert response.headers["www-authenticate"].startswith("Basic ")


async def test_development_token_endpoint_answers_an_unreadable_body_in_json(
    playground: tuple[str, Path],
) -> None:
    """The token endpoint's clients read OAuth JSON errors, not the browser pages' error page."""
    url, _ = playground
    async with local_client() as http:
        response = await http.post(
            f"{url}/dev-idp/token",
            content=b"x",
            headers={"Content-Type": "multipart/form-data"},  # no boundary
        )

    assert response.status_code == 400
    assert response.json() == {"error": "invalid_request"}
