"""What a tool call answers when it cannot get the credential (besides asking the user)."""

from __future__ import annotations

from typing import Literal

from mcp.server.mcpserver.exceptions import ToolError

Ended = Literal["declined", "cancelled", "expired", "failed"]
ENDED_MESSAGES: dict[str, str] = {
    "declined": "You declined to connect {provider}; the tool did not run.",
    "cancelled": "Connecting {provider} was cancelled; call the tool again to retry.",
    "expired": "The link to connect {provider} expired; call the tool again for a new one.",
    "failed": "Connecting {provider} failed; call the tool again to retry.",
}


class ConnectionNotMade(ToolError):
    """The user declined, cancelled, let the link expire, or the connection failed."""

    def __init__(self, provider: str, status: Ended, detail: str | None = None) -> None:
        message = ENDED_MESSAGES[status].format(provider=provider)
        super().__init__(f"{message} {detail}" if detail else message)
        self.provider = provider
        self.status = status


class BrokerUnavailable(ToolError):
    """The broker could not be reached, failed (5xx) or refused this server's address for a
    while (429); the call may be retried later."""

    def __init__(self) -> None:
        super().__init__("Connect Broker is unavailable; try again shortly.")


class BrokerRefused(RuntimeError):
    """The broker refused the service's request: a deployment error (secret, provider, issuer).

    Left uncaught in a tool, the SDK logs it as a crash and the client sees a generic error.
    """

    def __init__(self, status_code: int, code: str) -> None:
        super().__init__(f"Connect Broker refused the request: HTTP {status_code} {code}")
        self.status_code = status_code
        self.code = code
