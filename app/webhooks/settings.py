"""`[webhooks.<name>]`: where lifecycle events are posted, with which secret, which events.

The HMAC secret is only ever read from a file (`secret_file`): the configuration itself never
holds it, so the file can be a mounted secret readable by the broker alone.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    SecretStr,
    field_validator,
    model_validator,
)

# Every event the broker records (docs/operations.md, "Audit events"); `"*"` means all of them.
EVENTS = frozenset(
    {
        "flow.created",
        "flow.completed",
        "flow.declined",
        "flow.cancelled",
        "flow.expired",
        "credential.stored",
        "credential.refreshed",
        "credential.refresh_rejected",
        "connection.disconnected",
        "connection.revoked",
        "connection.idle_revoked",
        "revocation.confirmed",
        "revocation.skipped",
        "revocation.abandoned",
        "service.created",
        "service.revoked",
        "keys.rotated",
        "user.erased",
    }
)
ALL_EVENTS = "*"
MIN_SECRET_CHARACTERS = 16


class WebhookSettings(BaseModel):
    """One receiver of signed event deliveries (app/webhooks/delivery.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    secret_file: Path
    events: tuple[str, ...] = (ALL_EVENTS,)
    _secret: SecretStr = PrivateAttr(default=SecretStr(""))

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urlsplit(value)
        if not value.isascii() or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an absolute http(s) URL")
        if parts.username or parts.password:
            raise ValueError("must not contain user info (the signature authenticates the broker)")
        if parts.fragment or value.endswith("#"):
            raise ValueError("must not contain a fragment")
        return value

    @field_validator("events")
    @classmethod
    def _events(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError(f'name at least one event, or "{ALL_EVENTS}" for all')
        if ALL_EVENTS in value:
            if len(value) > 1:
                raise ValueError(f'"{ALL_EVENTS}" already means every event; name nothing else')
            return value
        unknown = sorted(set(value) - EVENTS)
        if unknown:
            raise ValueError(
                f"unknown event {unknown[0]!r} (known: {', '.join(sorted(EVENTS))}, or "
                f'"{ALL_EVENTS}")'
            )
        return tuple(dict.fromkeys(value))

    @field_validator("secret_file")
    @classmethod
    def _secret_file(cls, value: Path) -> Path:
        _read_secret(value)
        return value

    @model_validator(mode="after")
    def _keep_secret(self) -> WebhookSettings:
        self._secret = SecretStr(_read_secret(self.secret_file))
        return self

    @property
    def secret(self) -> SecretStr:
        return self._secret

    @property
    def display_url(self) -> str:
        """The URL without its query, for output (a query may carry a receiver's token)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}{parts.path}"

    @property
    def event_filter(self) -> tuple[str, ...] | None:
        """The events to post, or None for all."""
        return None if self.events == (ALL_EVENTS,) else self.events


RETENTION_FLOOR_DAYS = 2  # events are retried for 24 h: the retention sweep must not take them


def _read_secret(path: Path) -> str:
    """The secret in `path`, stripped.

    Raises:
        ValueError: the file is unreadable, empty or too short to be a secret.
    """
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"cannot read {path}: {reason}") from None
    if not text:
        raise ValueError(f"{path} is empty; put the webhook's secret in it")
    if len(text) < MIN_SECRET_CHARACTERS:
        raise ValueError(
            f"{path} must hold a secret of at least {MIN_SECRET_CHARACTERS} characters "
            "(e.g. `openssl rand -hex 32`)"
        )
    return text
