"""The elicitation round: the broker's InputRequiredResult as the call's result, and back.

A tool raises `ConnectionRequired`; `ResultMiddleware` (added by `ConnectBroker.install`) answers
the call with the broker's `inputRequests` and a requestState that holds a `PendingRound`.

requestState: the broker's state is sealed and bound by the broker (service, user, provider, call
digest). MCPServer seals every outgoing requestState again (`RequestStateBoundary`, on by default;
this middleware runs inside it), so the client echoes the SDK's envelope around
{"provider", "keys", "state"}, and the broker's state inside returns to the broker byte for byte.
The envelope adds the SDK's own request and principal binding; a sibling running several instances
configures shared keys (`MCPServer(request_state_security=RequestStateSecurity(keys=[...]))`), as
for any MCPServer state. Naming the provider lets one tool require several providers in turn:
each `require` resumes only its own round.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, SERVER_INFO_META_KEY
from mcp_types import methods as mcp_methods

STATE_VERSION = 1


class ConnectionRequired(MCPError):
    """Raised by `require`: the call must answer the broker's InputRequiredResult.

    An `MCPError`, so the SDK's tool layer re-raises it untouched up to `ResultMiddleware`
    instead of turning it into an `isError` result.
    """

    def __init__(self, input_requests: dict[str, Any], request_state: str) -> None:
        super().__init__(INTERNAL_ERROR, "Internal error")  # only if the middleware is missing
        self.input_requests = input_requests
        self.request_state = request_state


@dataclass(frozen=True)
class PendingRound:
    """What this helper puts inside the SDK-sealed requestState of an elicitation round."""

    provider: str
    keys: tuple[str, ...]  # the inputRequests keys, to find the client's answer on the retry
    state: str  # the broker's requestState, exactly as the broker issued it

    def dump(self) -> str:
        value = {"v": STATE_VERSION, "provider": self.provider, "keys": self.keys}
        return json.dumps(value | {"state": self.state}, separators=(",", ":"))

    @classmethod
    def load(cls, request_state: str | None, provider: str) -> PendingRound | None:
        """This provider's pending round, or None (no state, another provider's, or not ours)."""
        if not request_state:
            return None
        try:
            value = json.loads(request_state)
            pending = cls(value["provider"], tuple(value["keys"]), value["state"])
        except (ValueError, KeyError, TypeError):
            return None
        if value.get("v") != STATE_VERSION or pending.provider != provider:
            return None
        if not isinstance(pending.state, str) or not all(isinstance(k, str) for k in pending.keys):
            return None
        return pending


class ResultMiddleware:
    """Server middleware: a `ConnectionRequired` raised by a handler becomes the call's result.

    It sits inside the SDK's RequestStateBoundary, which seals the requestState it returns.
    """

    def __init__(self) -> None:
        self.server_info: dict[str, str] | None = None

    async def __call__(
        self, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        try:
            return await call_next(ctx)
        except ConnectionRequired as required:
            wire = {
                "resultType": "input_required",
                "inputRequests": required.input_requests,
                "requestState": required.request_state,
            }
            # A result returned by middleware skips the SDK's own serialization: validate it
            # against the protocol surface and stamp serverInfo as the SDK would (spec #3002).
            result = mcp_methods.serialize_server_result(ctx.method, ctx.protocol_version, wire)
            if self.server_info is not None:
                result["_meta"] = {SERVER_INFO_META_KEY: dict(self.server_info)}
            return result
