"""What a delivery carries: the event as JSON, and headers that let the receiver check it.

The body is the event's row under stable names; the signature is HMAC-SHA256, keyed with the
webhook's secret, over `<timestamp>.<body>` (the timestamp being the delivery's, in Unix
seconds), hex-encoded (docs/webhooks.md shows a receiver's check).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import UTC, datetime
from typing import Any

from app.models import AuditEvent

EVENT_HEADER = "X-Connect-Broker-Event"
EVENT_ID_HEADER = "X-Connect-Broker-Event-Id"
TIMESTAMP_HEADER = "X-Connect-Broker-Timestamp"
SIGNATURE_HEADER = "X-Connect-Broker-Signature"
SIGNATURE_VERSION = "v1"


def payload(event: AuditEvent) -> dict[str, Any]:
    """The event's fields as a receiver sees them (audit rows hold no secret)."""
    return {
        "id": event.id,
        "event": event.event,
        "occurred_at": event.occurred_at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "actor": {"kind": event.actor_kind, "id": event.actor_id},
        "issuer": event.issuer,
        "subject": event.subject,
        "provider": event.provider,
        "audience": event.audience,
        "account_label": event.account_label,
        "detail": event.detail,
        "request_id": event.request_id,
    }


def body(event: AuditEvent) -> bytes:
    return json.dumps(payload(event), separators=(",", ":"), ensure_ascii=False).encode()


def signature(secret: str, timestamp: int, content: bytes) -> str:
    """`v1=<hex HMAC-SHA256 of "<timestamp>.<content>">`."""
    signed = str(timestamp).encode() + b"." + content
    digest = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return f"{SIGNATURE_VERSION}={digest}"


def headers(event: AuditEvent, secret: str, content: bytes, now: datetime) -> dict[str, str]:
    timestamp = int(now.timestamp())
    return {
        "Content-Type": "application/json",
        EVENT_HEADER: event.event,
        EVENT_ID_HEADER: str(event.id),
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(secret, timestamp, content),
    }
