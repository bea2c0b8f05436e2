"""Connect Broker for sibling MCP servers built on the official `mcp` SDK (`MCPServer`).

A sibling asks the broker for the caller's third-party credential from a tool handler; when the
user has not connected the account yet, the tool answers the broker's URL-mode elicitation and the
client's retry of the same call gets the credential (see `connect_broker_client.broker`). The
package depends on `mcp` (and through it on `httpx2` and PyJWT) only, never on the broker's `app`.
"""

from connect_broker_client.broker import ConnectBroker, Credential
from connect_broker_client.errors import BrokerRefused, BrokerUnavailable, ConnectionNotMade
from connect_broker_client.rounds import ConnectionRequired
from connect_broker_client.tokens import IdpTokenVerifier

__all__ = [
    "BrokerRefused",
    "BrokerUnavailable",
    "ConnectBroker",
    "ConnectionNotMade",
    "ConnectionRequired",
    "Credential",
    "IdpTokenVerifier",
]
