"""What the MCP endpoint uses, built once at start-up (app/main.py) and handed to every method."""

from __future__ import annotations

from dataclasses import dataclass

from app.auth.bearer import TokenVerifier
from app.config import Settings
from app.connect.context import RoundContext
from app.connect.request_state import RequestStateCodec
from app.limits import RateLimits
from app.mcp.registry import ToolRegistry
from app.metrics import BrokerMetrics
from app.security_log import SecurityLog

SERVER_NAME = "connect-broker"
SERVER_VERSION = "0.1.0"
SERVER_INFO = {"name": SERVER_NAME, "version": SERVER_VERSION}


@dataclass(frozen=True, slots=True)
class McpServer:
    settings: Settings
    verifier: TokenVerifier  # the bearer token of every request
    security: SecurityLog  # failed authentications, security events
    limits: RateLimits  # the user's request budget
    metrics: BrokerMetrics
    registry: ToolRegistry
    codec: RequestStateCodec  # the sealed requestState of a connect round
    rounds: RoundContext
    allowed_origins: frozenset[str]
