"""Raw MCP requests (exact wire control) and a browser emulation for the broker's pages."""

from __future__ import annotations

import copy
import html
import itertools
import re
from http.cookies import SimpleCookie
from typing import Any

import httpx2

from .http import local_client
from .idp import idp_login

PROTOCOL_VERSION = "2026-07-28"
# Idle connections are dropped after 2 s: the test IdP (node) and the fake GitHub (uvicorn) close
# theirs after 5 s, httpx's default expiry, and a request sent on one just as it closes fails.
CLIENT_LIMITS = httpx2.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=2.0
)
URL_CAPS: dict[str, Any] = {"elicitation": {"url": {}, "form": {}}}
_ids = itertools.count(1)


def request_body(
    method: str,
    params: dict[str, Any] | None = None,
    *,
    capabilities: dict[str, Any] | None = None,
    version: str = PROTOCOL_VERSION,
    request_id: Any = None,
) -> dict[str, Any]:
    meta = {
        "io.modelcontextprotocol/protocolVersion": version,
        "io.modelcontextprotocol/clientInfo": {"name": "test-client", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": (
            copy.deepcopy(URL_CAPS) if capabilities is None else capabilities
        ),
    }
    return {
        "jsonrpc": "2.0",
        "id": next(_ids) if request_id is None else request_id,
        "method": method,
        "params": {**(params or {}), "_meta": meta},
    }


def request_headers(body: dict[str, Any], token: str | None) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": str(
            body.get("params", {})
            .get("_meta", {})
            .get("io.modelcontextprotocol/protocolVersion", PROTOCOL_VERSION)
        ),
        "Mcp-Method": str(body.get("method", "")),
    }
    name = body.get("params", {}).get("name")
    if isinstance(name, str):
        headers["Mcp-Name"] = name
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


class McpHttp:
    """Sends hand-built MCP requests to one broker."""

    def __init__(self, mcp_url: str) -> None:
        self.mcp_url = mcp_url
        self.http = local_client(timeout=60, limits=CLIENT_LIMITS)

    async def post(
        self,
        body: Any,
        *,
        token: str | None,
        headers: dict[str, str] | None = None,
        drop: tuple[str, ...] = (),
        raw: bytes | None = None,
    ) -> httpx2.Response:
        base = (
            request_headers(body, token)
            if isinstance(body, dict)
            else {
                "Content-Type": "application/json",
                **({"Authorization": f"Bearer {token}"} if token else {}),
            }
        )
        merged = {k: v for k, v in {**base, **(headers or {})}.items() if k not in drop}
        content = raw if raw is not None else httpx2.Request("POST", "/", json=body).content
        return await self.http.post(self.mcp_url, content=content, headers=merged)

    async def call_tool(
        self,
        token: str,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        capabilities: dict[str, Any] | None = None,
        input_responses: dict[str, Any] | None = None,
        request_state: Any = None,
    ) -> httpx2.Response:
        params: dict[str, Any] = {"name": name, "arguments": arguments or {}}
        if input_responses is not None:
            params["inputResponses"] = input_responses
        if request_state is not None:
            params["requestState"] = request_state
        body = request_body("tools/call", params, capabilities=capabilities)
        return await self.post(body, token=token)

    async def aclose(self) -> None:
        await self.http.aclose()


class Browser:
    """An HTTP-only stand-in for a browser: cookies, manual redirects, login at the IdP.

    Browsers send `Secure` cookies to http://127.0.0.1 (a secure context) but Python's cookie jar
    does not, so the broker's cookies are kept here by hand; the IdP's go in the client's jar.
    """

    def __init__(self, broker_url: str) -> None:
        self.broker_url = broker_url
        self.cookies: dict[str, str] = {}
        self.http = local_client(timeout=30, follow_redirects=False, limits=CLIENT_LIMITS)

    def _absorb(self, response: httpx2.Response) -> httpx2.Response:
        for header in response.headers.get_list("set-cookie"):
            parsed: SimpleCookie = SimpleCookie()
            parsed.load(header)
            for name, morsel in parsed.items():
                if morsel["max-age"] == "0":
                    self.cookies.pop(name, None)
                else:
                    self.cookies[name] = morsel.value
        return response

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        return headers

    async def login_as(self, user: str, next_path: str = "/connections") -> httpx2.Response:
        start = await self.get("/login", params={"next": next_path})
        assert start.status_code == 303, start.text
        back = await idp_login(self.http, start.headers["location"], user=user)
        callback = self._absorb(
            await self.http.get(back.headers["location"], headers=self._headers())
        )
        assert callback.status_code == 303, callback.text
        return callback

    async def get(self, path: str, **kwargs: Any) -> httpx2.Response:
        headers = self._headers(kwargs.pop("headers", None))
        return self._absorb(
            await self.http.get(f"{self.broker_url}{path}", headers=headers, **kwargs)
        )

    async def post(self, path: str, **kwargs: Any) -> httpx2.Response:
        headers = self._headers({"Origin": self.broker_url, **kwargs.pop("headers", {})})
        return self._absorb(
            await self.http.post(f"{self.broker_url}{path}", headers=headers, **kwargs)
        )

    async def csrf_token(self, path: str) -> str:
        page = await self.get(path)
        match = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert match, page.text
        return match.group(1)

    def on_new_connection(self, url: str | None = None) -> Browser:
        """The same session (its cookies) on a client of its own, so on a new connection; at
        `url` instead of the broker's (a relay in front of it) when given."""
        other = Browser(url or self.broker_url)
        other.cookies = dict(self.cookies)
        return other

    async def aclose(self) -> None:
        await self.http.aclose()


def flow_id_from(result: dict[str, Any]) -> tuple[str, str]:
    """(input key, flow id) of a URL-mode connect elicitation."""
    ((key, request),) = result["inputRequests"].items()
    url: str = request["params"]["url"]
    return key, url.rsplit("/", 1)[1]


REFRESH = re.compile(r'<meta http-equiv="refresh" content="0; url=([^"]+)">')
PROVIDER_LINK = re.compile(r'<a href="([^"]+)" data-action="go-to-provider"')


def provider_url(started: httpx2.Response) -> str:
    """The provider's authorize URL that the consent form's answer sends the browser on to (a
    page with a refresh and the same URL as a link: templates/connect/continue.html)."""
    assert started.status_code == 200, started.text
    refresh, link = REFRESH.search(started.text), PROVIDER_LINK.search(started.text)
    assert refresh is not None and link is not None, started.text
    assert refresh.group(1) == link.group(1)
    return html.unescape(refresh.group(1))
