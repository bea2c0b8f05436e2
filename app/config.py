"""Process configuration: one TOML file, every key overridable from the environment.

The file comes from `--config PATH`, else `BROKER_CONFIG`, else `./broker.toml` (optional).
`BROKER_<SECTION>_<KEY>` overrides `[section] key`; for providers the variable is
`BROKER_PROVIDERS_<NAME>_<KEY>`. A key ending in `_file` names a file whose content is the value
of the key without the suffix (for secrets mounted as files). Errors name the offending key.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from app.config_sources import SECTIONS, read_raw
from app.config_sources import ConfigError as ConfigError  # re-exported: callers import it here
from app.config_sources import config_path as config_path
from app.display import display_text
from app.providers.presets import apply_preset
from app.providers.settings import ProviderSettings, provider_settings_adapter

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,32}:[A-Za-z0-9_-]{43}=?$")
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    public_url: str = "http://127.0.0.1:8000"
    allowed_origins: tuple[str, ...] = ()
    retry_wait_seconds: float = Field(default=20, ge=0, le=120)
    flow_ttl_seconds: int = Field(default=600, ge=60, le=3600)
    max_body_bytes: int = Field(default=256 * 1024, ge=1024, le=16 * 1024 * 1024)
    login_max_age_seconds: int = Field(default=12 * 3600, ge=60)
    session_ttl_seconds: int = Field(default=3600, ge=60, le=24 * 3600)
    # GET /metrics answers only a scrape presenting this bearer token; unset, it answers 404
    metrics_token: SecretStr | None = None

    @field_validator("metrics_token")
    @classmethod
    def _metrics_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters (e.g. `openssl rand -hex 32`)")
        return value

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str) -> str:
        return validate_public_url(value)

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for origin in value:
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
                raise ValueError(f"{origin!r} is not an origin like https://host[:port]")
        return value


class DatabaseSettings(_Section):
    url: str = "sqlite:///./data/broker.db"
    pool_size: int = Field(default=10, ge=1, le=100)


class IdentitySettings(_Section):
    issuer: str = ""
    audience: str = ""
    identity_claim: str = "sub"
    login_client_id: str = ""
    login_client_secret: SecretStr = SecretStr("")
    required_scopes: tuple[str, ...] = ()
    algorithms: tuple[str, ...] = ("RS256", "PS256", "ES256", "EdDSA")


class KeySettings(_Section):
    signing: tuple[SecretStr, ...] = ()
    encryption: tuple[SecretStr, ...] = ()

    @field_validator("signing", "encryption")
    @classmethod
    def _keys(cls, value: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for key in value:
            if not KEY_PATTERN.match(key.get_secret_value()):
                raise ValueError(
                    'each key must be "<key-id>:<base64url of 32 random bytes>" '
                    "(run `connect-broker keys generate`)"
                )
        ids = [key.get_secret_value().split(":", 1)[0] for key in value]
        if len(set(ids)) != len(ids):
            raise ValueError("key ids must be unique")
        return value


class LimitSettings(_Section):
    """`[limits]`: per-process rate limits (app/limits.py); a per-minute budget of 0 is off."""

    user_requests_per_minute: int = Field(default=600, ge=0)
    user_burst: int = Field(default=120, ge=1)
    failed_auths_per_minute: int = Field(default=60, ge=0)
    failed_auth_burst: int = Field(default=30, ge=1)


class ServiceSettings(_Section):
    """`[services.<name>]`: what a registered sibling server may read beyond its own."""

    share_from: tuple[str, ...] = ()  # audiences ("mcp" or service names) it may also read
    display_name: str | None = None


@dataclass(frozen=True)
class Settings:
    """The validated configuration. Built once at start-up and never changed."""

    server: ServerSettings
    database: DatabaseSettings
    identity: IdentitySettings
    keys: KeySettings
    providers: Mapping[str, ProviderSettings]
    services: Mapping[str, ServiceSettings] = field(default_factory=dict)
    limits: LimitSettings = field(default_factory=LimitSettings)
    source: str = "defaults"

    @property
    def public_url(self) -> str:
        return self.server.public_url

    @property
    def mcp_url(self) -> str:
        return f"{self.public_url}/mcp"

    @property
    def audience(self) -> str:
        return self.identity.audience or self.mcp_url

    @functools.cached_property
    def public_origin(self) -> str:
        parts = urlsplit(self.public_url)
        return f"{parts.scheme}://{parts.netloc}"

    @property
    def is_https(self) -> bool:
        return self.public_url.startswith("https://")

    def service_display_name(self, name: str) -> str:
        """How pages name a sibling service: its configured `display_name`, else its name."""
        service = self.services.get(name)
        return display_text(service.display_name if service and service.display_name else name)


def validate_public_url(value: str) -> str:
    """Accept only an absolute http(s) origin-plus-path we can safely put in elicitation URLs."""
    if not value.isascii():
        raise ValueError("must be ASCII (a look-alike host is refused; use the punycode form?)")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an absolute http(s) URL")
    if parts.username or parts.password:
        raise ValueError("must not contain user info")
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        raise ValueError("must not contain a query or fragment")
    if any(label.startswith("xn--") for label in parts.hostname.split(".")):
        raise ValueError("punycode (xn--) hosts are refused: they can imitate another name")
    if parts.scheme == "http" and not _is_loopback(parts.hostname):
        raise ValueError("must use https (http is allowed only for loopback hosts)")
    return value.rstrip("/")


def _is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_settings(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read, merge and validate the configuration.

    Raises:
        ConfigError: naming the bad key.
    """
    raw = read_raw(path, os.environ if environ is None else environ, overrides or {})
    return _validate(raw, source=str(path) if path else "defaults")


LIST_KEYS = {
    ("server", "allowed_origins"),
    ("identity", "required_scopes"),
    ("identity", "algorithms"),
    ("keys", "signing"),
    ("keys", "encryption"),
}


def _validate(raw: dict[str, Any], *, source: str) -> Settings:
    unknown = set(raw) - {*SECTIONS, "providers", "services"}
    if unknown:
        raise ConfigError(f"{sorted(unknown)[0]}: unknown section")
    sections: dict[str, Any] = {}
    models: dict[str, type[_Section]] = {
        "server": ServerSettings,
        "database": DatabaseSettings,
        "identity": IdentitySettings,
        "keys": KeySettings,
        "limits": LimitSettings,
    }
    for name, model in models.items():
        values = dict(raw.get(name, {}))
        for key, value in values.items():
            if (name, key) in LIST_KEYS and isinstance(value, str):
                values[key] = [item.strip() for item in value.split(",") if item.strip()]
        sections[name] = _parse(model, values, name)
    providers: dict[str, ProviderSettings] = {}
    for name, values in raw.get("providers", {}).items():
        if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", name):
            raise ConfigError(f"providers.{name}: names are lowercase letters, digits, - and _")
        if isinstance(values.get("scopes"), str):  # from the environment: a comma list
            values = {
                **values,
                "scopes": [v.strip() for v in values["scopes"].split(",") if v.strip()],
            }
        try:
            providers[name] = provider_settings_adapter.validate_python(apply_preset(values))
        except ValidationError as exc:
            raise ConfigError(_describe(exc, f"providers.{name}")) from None
    services: dict[str, ServiceSettings] = {}
    for name, values in raw.get("services", {}).items():
        services[name] = _parse(ServiceSettings, dict(values), f"services.{name}")
    return Settings(source=source, providers=providers, services=services, **sections)


def _parse(model: type[_Section], values: dict[str, Any], name: str) -> Any:
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, name)) from None


PROVIDER_KINDS = ("api_key", "oauth2", "oidc")  # pydantic puts the union tag first in `loc`


def _describe(exc: ValidationError, prefix: str) -> str:
    error = exc.errors()[0]
    parts = [str(part) for part in error["loc"] if not isinstance(part, int)]
    if prefix.startswith("providers.") and parts and parts[0] in PROVIDER_KINDS:
        parts = parts[1:]
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        parts, error["msg"] = ["kind"], "must be one of api_key, oauth2, oidc"
    location = ".".join(parts)
    key = f"{prefix}.{location}" if location else prefix
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    return f"{key}: {message}"


Mode = Literal["serve", "dev"]


def load_serve_settings(explicit: str | None) -> Settings:
    """The configuration file (`explicit`, else $BROKER_CONFIG or ./broker.toml) with the
    environment's overrides, checked for `serve` (`require_serve_ready`)."""
    settings = load_settings(config_path(explicit))
    require_serve_ready(settings)
    return settings


def require_serve_ready(settings: Settings) -> None:
    """Checks `serve` needs beyond syntax: an issuer, a login client and keys.

    Raises:
        ConfigError: naming the missing key.
    """
    identity = settings.identity
    if not identity.issuer:
        raise ConfigError("identity.issuer: required (the IdP whose tokens /mcp accepts)")
    try:
        validate_public_url(identity.issuer)
    except ValueError as exc:
        raise ConfigError(f"identity.issuer: {exc}") from None
    if not identity.login_client_id:
        raise ConfigError("identity.login_client_id: required (the broker's own login client)")
    if not settings.keys.signing:
        raise ConfigError("keys.signing: at least one key is required")
    if not settings.keys.encryption:
        raise ConfigError("keys.encryption: at least one key is required")
