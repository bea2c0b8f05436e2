"""The identity everything is keyed on: (issuer, identity claim), compared exactly. Never email."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Principal:
    issuer: str
    subject: str


@dataclass(frozen=True)
class McpCaller:
    """A verified MCP access token: who, through which OAuth client, with which scopes."""

    principal: Principal
    client_id: str
    scopes: frozenset[str]
