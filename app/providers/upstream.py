"""HTTP to a third-party provider, under the rules every such call keeps.

A total deadline (httpx timeouts are per operation, SECURITY.md §5.7), no redirect followed (F8),
at most 64 KiB read (F7), and bodies never logged, only their content type and length.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import parse_qsl

import httpx2

from app.providers.settings import OAuthProviderSettings

logger = logging.getLogger("broker.providers")

MAX_RESPONSE_BYTES = 64 * 1024


class UpstreamError(Exception):
    """The provider failed or answered something unusable. `reason` is safe to log and show."""

    def __init__(self, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


async def send_capped(
    provider: OAuthProviderSettings, http: httpx2.AsyncClient, request: httpx2.Request
) -> tuple[int, str, bytes]:
    """Send `request` under the rules above: (status, content type, body).

    Raises:
        UpstreamError: timeout, network failure, a body over the cap, or a redirect.
    """
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(provider.timeout_seconds):
            response = await http.send(request, stream=True, follow_redirects=False)
            try:
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > MAX_RESPONSE_BYTES:
                        raise UpstreamError("response_too_large")
                    chunks.append(chunk)
            finally:
                await response.aclose()
    except TimeoutError:
        raise UpstreamError("timeout", timed_out=True) from None
    except httpx2.HTTPError as exc:
        raise UpstreamError(f"network:{type(exc).__name__}") from None
    content_type = response.headers.get("content-type", "")
    logger.info(
        "oauth.response status=%d type=%s bytes=%d",
        response.status_code,
        content_type.split(";")[0][:40],
        size,
    )
    if 300 <= response.status_code < 400:
        raise UpstreamError(f"redirect_{response.status_code}")
    return response.status_code, content_type, b"".join(chunks)


def parse_body(content_type: str, raw: bytes) -> dict[str, Any]:
    """A JSON object, or a form-encoded body (some token endpoints answer so) as a dict.

    JSON nested deeper than the parser's recursion limit (64 KiB of `[` is enough) is as
    unusable as any other malformed body: RecursionError is not a ValueError, and escaping here
    it would be a 500 that leaves a flow mid-exchange.

    Raises:
        UpstreamError: `malformed_response`.
    """
    try:
        if "application/x-www-form-urlencoded" in content_type:
            return dict(parse_qsl(raw.decode("utf-8"), strict_parsing=True))
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise UpstreamError("malformed_response") from None
    if not isinstance(document, dict):
        raise UpstreamError("malformed_response")
    return document


async def get_json(
    provider: OAuthProviderSettings, http: httpx2.AsyncClient, url: str, access_token: str
) -> dict[str, Any]:
    """GET `url` with a bearer token: the JSON object of a 2xx answer."""
    request = http.build_request(
        "GET",
        url,
        headers={"Authorization": f"Bearer {access_token}", "Accept": "application/json"},
    )
    status, content_type, raw = await send_capped(provider, http, request)
    if not 200 <= status < 300:
        raise UpstreamError(f"status_{status}")
    return parse_body(content_type, raw)


async def get_api_json(
    provider: OAuthProviderSettings, http: httpx2.AsyncClient, path: str, access_token: str
) -> dict[str, Any]:
    """GET `<api_base_url><path>` with the user's token (for provider-backed tools).

    Raises:
        UpstreamError: the call failed.
    """
    base = (provider.api_base_url or "").rstrip("/")
    return await get_json(provider, http, f"{base}{path}", access_token)
