"""`tools/call` with multi-round-trip requests and the connect-flow retry check.

Round 1: the tool runs; if it raises ConnectionRequired we create a flow and answer an
InputRequiredResult with a URL-mode elicitation (`-32021` if the client did not declare
`elicitation.url`). Retry: the sealed requestState must verify (integrity, age, principal, client,
tool, argument digest) or the answer is `-32602`; then the flow decides: completed → the tool runs
again and its result is final; still open → wait (bounded, no DB connection held), then re-issue the
same URL with a fresh state; declined/cancelled/expired → an `isError` result.
"""

from __future__ import annotations

from typing import Any

from app.auth.principal import McpCaller
from app.connect.refresh import KnownRows
from app.connect.request_state import StatePayload, StateRejected, arguments_digest
from app.connect.require import (
    URL_ELICITATION,
    Elicitation,
    RoundAsk,
    elicitation,
    start_round,
)
from app.connect.rounds import ACTIONS, mark_delivered, resume_round
from app.connect.service import FlowRead, FlowView
from app.display import display_text
from app.mcp.accounts import (
    STATE_KEY,
    AccountChoiceRequired,
    BrokerConnections,
    choice_request,
    input_key,
)
from app.mcp.arguments import check_arguments
from app.mcp.envelope import HeaderMap, Message, check_param_headers
from app.mcp.progress import ProgressReporter
from app.mcp.protocol import META_CLIENT_INFO, invalid_params, missing_capability
from app.mcp.registry import (
    ConnectionRequired,
    Tool,
    ToolCall,
    ToolOutcome,
    ToolResult,
)
from app.mcp.server import McpServer
from app.models import BROKER_AUDIENCE, FlowStatus

CAPABILITY_FOR_METHOD = {
    "elicitation/create": "elicitation",
    "sampling/createMessage": "sampling",
    "roots/list": "roots",
}


class CallToolRound:
    """One `tools/call` request: verify, resume a flow if any, run the tool, shape the answer."""

    def __init__(
        self,
        server: McpServer,
        caller: McpCaller,
        message: Message,
        progress: ProgressReporter | None = None,
    ) -> None:
        self.server = server
        self.caller = caller
        self.message = message
        self.progress = progress
        params = message.params
        name = params.get("name")
        tool = server.registry.get(name) if isinstance(name, str) else None
        if tool is None:
            raise invalid_params(f"Unknown tool: {name!s:.128}")
        self.tool: Tool = tool
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise invalid_params("params.arguments must be an object")
        self.arguments: dict[str, Any] = arguments
        self.digest = arguments_digest(arguments)
        self.input_responses = _input_responses(params)
        client_info = message.meta.get(META_CLIENT_INFO)
        name_value = client_info.get("name") if isinstance(client_info, dict) else None
        self.client_name = display_text(name_value) if isinstance(name_value, str) else None

    async def run(self, headers: HeaderMap) -> dict[str, Any]:
        check_param_headers(headers, self.tool.input_schema, self.arguments)
        check_arguments(self.tool.name, self.tool.arguments_validator, self.arguments)
        state: StatePayload | None = None
        if "requestState" in self.message.params:
            try:
                state = self.server.codec.verify(
                    self.message.params["requestState"],
                    self.caller,
                    method="tools/call",
                    name=self.tool.name,
                    arguments_digest=self.digest,
                )
            except StateRejected as rejected:
                raise invalid_params(
                    "Invalid or expired requestState", reason=rejected.reason
                ) from None
        finished_flow: FlowRead | None = None
        known: KnownRows = {}
        if state is not None and state.flow_id is not None:
            resumed = await self._resume_flow(state.flow_id, state.input_key or "")
            if not isinstance(resumed, FlowRead):
                return resumed  # still waiting, declined, cancelled or expired
            finished_flow = resumed
            known = {(resumed.flow.provider, resumed.flow.audience): resumed.connection}
        connections = BrokerConnections(
            self.server.rounds,
            self.caller,
            self.message.capabilities,
            known=known,
            connected=finished_flow.flow.provider if finished_flow is not None else None,
        )
        data = state.data if state is not None and state.flow_id is None else None
        try:
            if isinstance(data, dict) and STATE_KEY in data:
                ended = await self._answer_choice(connections, data[STATE_KEY])
                if ended is not None:
                    return ended.to_wire()
                data = None  # the tool runs afresh, now with the account chosen
            call = ToolCall(
                name=self.tool.name,
                arguments=self.arguments,
                caller=self.caller,
                client_name=self.client_name,
                capabilities=self.message.capabilities,
                input_responses=self.input_responses,
                state=data,
                connections=connections,
                progress=self.progress,
            )
            outcome = await self.tool.handler(call)
        except ConnectionRequired as need:
            return await self._start_flow(need)
        except AccountChoiceRequired as choice:
            return self._ask_account(choice)
        if finished_flow is not None and isinstance(outcome, ToolResult):
            await mark_delivered(self.server.rounds, finished_flow)
        return self._shape(outcome)

    async def _answer_choice(self, connections: BrokerConnections, asked: Any) -> ToolResult | None:
        """The client's answer to an account choice this endpoint asked (sealed in the state)."""
        provider = asked.get("provider") if isinstance(asked, dict) else None
        offered = asked.get("offered") if isinstance(asked, dict) else None
        if not isinstance(provider, str) or not isinstance(offered, list):
            raise invalid_params("Invalid or expired requestState", reason="choice")
        response = self.input_responses.get(input_key(provider))
        return await connections.answer(provider, offered, response)

    def _ask_account(self, choice: AccountChoiceRequired) -> dict[str, Any]:
        """A form-mode elicitation of which account to use (the client declared form mode)."""
        settings = self.server.settings.providers.get(choice.provider)
        name = settings.display_name if settings else choice.provider
        request = choice_request(name, self.client_name or "this client", choice.names)
        asked = {"provider": choice.provider, "offered": list(choice.names)}
        return self._input_required({input_key(choice.provider): request}, data={STATE_KEY: asked})

    def _shape(self, outcome: ToolOutcome) -> dict[str, Any]:
        if isinstance(outcome, ToolResult):
            return outcome.to_wire()
        return self._input_required(outcome.requests, data=outcome.state)

    def _check_declared(self, key: str, request: dict[str, Any]) -> None:
        """MRTR server rule 7: only ask for what this request's capabilities declare; for
        elicitation also the mode (an empty `elicitation` object means form only)."""
        method = request.get("method")
        capability = CAPABILITY_FOR_METHOD.get(str(method))
        if capability is None:
            raise ValueError(f"input request {key!r} has an unsupported method")
        declared = self.message.capabilities.get(capability)
        if method == "elicitation/create":
            mode = (request.get("params") or {}).get("mode", "form")
            if not isinstance(declared, dict) or mode not in (declared or {"form": {}}):
                raise missing_capability({"elicitation": {mode: {}}})
        elif not isinstance(declared, dict):
            raise missing_capability({capability: {}})

    def _input_required(
        self,
        requests: dict[str, dict[str, Any]],
        *,
        data: Any = None,
        flow_id: str | None = None,
        input_key: str | None = None,
    ) -> dict[str, Any]:
        """Every input request checked against this request's capabilities, whoever built it
        (a tool, the account choice, a connect round), then the state sealed."""
        for key, request in requests.items():
            self._check_declared(key, request)
        state = self.server.codec.issue(
            self.caller,
            method="tools/call",
            name=self.tool.name,
            arguments_digest=self.digest,
            flow_id=flow_id,
            input_key=input_key,
            data=data,
        )
        return {"resultType": "input_required", "inputRequests": requests, "requestState": state}

    async def _start_flow(self, need: ConnectionRequired) -> dict[str, Any]:
        """The tool needs a connection the user does not hold: round 1's other half."""
        if need.provider not in self.server.settings.providers:
            return ToolResult(text=f"Unknown provider: {need.provider}", is_error=True).to_wire()
        ask = RoundAsk(
            caller=self.caller,
            provider=need.provider,
            scopes=need.scopes,
            audiences=(BROKER_AUDIENCE,),
            capabilities=self.message.capabilities,
            client_name=self.client_name,
            tool_name=self.tool.name,
            args_digest=self.digest,
        )
        outcome = await start_round(self.server.rounds, ask, granted=need.granted)
        if outcome.needs_url_capability:
            raise missing_capability(URL_ELICITATION)
        if outcome.too_many_open_flows is not None:
            return ToolResult(text=outcome.too_many_open_flows, is_error=True).to_wire()
        if outcome.elicit is None:  # start_round answers no credential
            raise ValueError("start_round answered without a flow")
        return self._elicit(outcome.elicit)

    def _elicit(self, asked: Elicitation) -> dict[str, Any]:
        return self._input_required(
            {asked.key: asked.request}, flow_id=asked.flow.id, input_key=asked.key
        )

    async def _resume_flow(self, flow_id: str, key: str) -> dict[str, Any] | FlowRead:
        """The answer for a retry of a connect round, or the flow (and its connection) when it
        is done."""
        principal = self.caller.principal
        response = self.input_responses.get(key)
        action = response.get("action") if isinstance(response, dict) else None
        if response is not None and action not in ACTIONS:
            raise invalid_params(f"inputResponses.{key}.action must be accept, decline or cancel")
        outcome = await resume_round(
            self.server.rounds,
            flow_id=flow_id,
            principal=principal,
            action=action,
            capabilities=self.message.capabilities,
        )
        if outcome.done is not None:
            return outcome.done
        if outcome.needs_url_capability:
            raise missing_capability(URL_ELICITATION)
        if outcome.open is not None:
            return self._elicit(elicitation(self.server.rounds, outcome.open))
        return self._ended(outcome.flow, outcome.ended or FlowStatus.expired)

    def _ended(self, flow: FlowView | None, status: str) -> dict[str, Any]:
        provider = self.server.settings.providers.get(flow.provider) if flow else None
        name = provider.display_name if provider else "the account"
        messages: dict[str, str] = {
            FlowStatus.declined: f"The user declined to connect {name}.",
            FlowStatus.cancelled: (
                f"Connecting {name} was cancelled. Call the tool again to get a new link."
            ),
            FlowStatus.failed: (
                f"Connecting {name} failed. Call the tool again to get a new link."
            ),
        }
        text = messages.get(
            status, f"The link to connect {name} expired. Call the tool again to get a new link."
        )
        return ToolResult(
            text=text,
            structured={"status": status if status in messages else FlowStatus.expired},
            is_error=True,
        ).to_wire()


def _input_responses(params: dict[str, Any]) -> dict[str, Any]:
    responses = params.get("inputResponses")
    if responses is None:
        return {}
    if not isinstance(responses, dict):
        raise invalid_params("params.inputResponses must be an object")
    for key, value in responses.items():
        if not isinstance(value, dict):
            raise invalid_params(f"inputResponses.{key!s:.64} must be an object")
    return responses
