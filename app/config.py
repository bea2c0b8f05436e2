"""Process configuration: one TOML file, every key overridable from the environment.

The file comes from `--config PATH`, else `BROKER_CONFIG`, else `./broker.toml` (optional).
`BROKER_<SECTION>_<KEY>` overrides `[section] key`; for providers the variable is
`BROKER_PROVIDERS_<NAME>_<KEY>`. A key ending in `_file` names a file whose content is the value
of the key without the suffix (for secrets mounted as files); the environment's `X` or `X_FILE`
wins over the file's `x` and `x_file` alike. A list or table key given as one string (from the
environment or a `_file`) is JSON when it starts with `[` or `{`, else a comma-separated list
(`_from_text`). Errors name the offending key.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo

from app.config_sources import NAMED_TABLES, SECTIONS, read_raw
from app.config_sources import ConfigError as ConfigError  # re-exported: callers import it here
from app.config_sources import config_path as config_path
from app.display import display_text
from app.providers.presets import apply_preset
from app.providers.settings import (
    ApiKeyProviderSettings,
    OAuthProviderSettings,
    ProviderSettings,
    provider_settings_adapter,
)
from app.urls import validate_public_url
from app.webhooks.settings import RETENTION_FLOOR_DAYS, WebhookSettings

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,32}:[A-Za-z0-9_-]{43}=?$")

# The JWS algorithms a configured list may name: the asymmetric signatures joserfc verifies.
# With `none` (no signature at all) or HS256/384/512 (a shared secret, here the keys the IdP
# publishes, which anyone can read) anyone could make a token the broker accepts.
SIGNATURE_ALGORITHMS = (
    *("RS256", "RS384", "RS512"),
    *("PS256", "PS384", "PS512"),
    *("ES256", "ES384", "ES512"),
    "EdDSA",
)


def _signature_algorithms(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise ValueError("name at least one algorithm (e.g. RS256)")
    for name in value:
        if name not in SIGNATURE_ALGORITHMS:
            raise ValueError(
                f"{name!r:.40} is not an asymmetric signature algorithm; use some of "
                + ", ".join(SIGNATURE_ALGORITHMS)
            )
    return value


# Every configured list of JWS algorithms (`identity.algorithms`) takes this type.
SignatureAlgorithms = Annotated[tuple[str, ...], AfterValidator(_signature_algorithms)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    public_url: str = "http://127.0.0.1:8000"
    allowed_origins: tuple[str, ...] = ()
    retry_wait_seconds: float = Field(default=20, ge=0, le=120)
    flow_ttl_seconds: int = Field(default=600, ge=60, le=3600)
    max_body_bytes: int = Field(default=256 * 1024, ge=1024, le=16 * 1024 * 1024)
    # every other body (/api/v1, the browser forms): counted as it arrives, refused past this
    max_api_body_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    # a connection completes each request's headers within this, or is closed (app/serving.py)
    header_timeout_seconds: float = Field(default=10, gt=0, le=300)
    # open connections per process; one more is answered 503 (below the descriptor limit, 1,024
    # by default, less the database pool, outbound connections and files)
    max_connections: int = Field(default=900, ge=1)
    login_max_age_seconds: int = Field(default=12 * 3600, ge=60)
    session_ttl_seconds: int = Field(default=3600, ge=60, le=24 * 3600)
    # GET /metrics answers only a scrape presenting this bearer token; unset, it answers 404
    metrics_token: SecretStr | None = None
    # the operators' documentation, linked from the landing page (GET /)
    docs_url: str | None = None

    @field_validator("docs_url")
    @classmethod
    def _docs_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError("must be an absolute http(s) URL")
        return value

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
    # PostgreSQL's password, kept out of `url` (e.g. from `password_file`, a mounted secret)
    password: SecretStr | None = None

    @field_validator("password")
    @classmethod
    def _password(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is None or "url" not in info.data:
            return value
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        if not value.get_secret_value():
            raise ValueError("is empty")
        try:
            parsed = make_url(info.data["url"])
        except ArgumentError:
            raise ValueError("database.url is not a database URL") from None
        if parsed.get_backend_name() not in ("postgresql", "postgres"):
            raise ValueError("only for a postgresql:// database.url")
        if parsed.password is not None:
            raise ValueError("database.url carries a password already; keep it in one place")
        return value

    def connect_url(self) -> str:
        """`url` with `password` merged in, for opening connections (never for display)."""
        if self.password is None:
            return self.url
        from sqlalchemy.engine import make_url

        merged = make_url(self.url).set(password=self.password.get_secret_value())
        return merged.render_as_string(hide_password=False)


class IdentitySettings(_Section):
    issuer: str = ""
    audience: str = ""
    identity_claim: str = "sub"
    login_client_id: str = ""
    login_client_secret: SecretStr = SecretStr("")
    required_scopes: tuple[str, ...] = ()
    # What auth discovery (401 challenge, resource metadata) tells clients to request when no
    # scope is required: a client that is told nothing guesses, or asks for none.
    default_scopes: tuple[str, ...] = ("openid",)
    algorithms: SignatureAlgorithms = ("RS256", "PS256", "ES256", "EdDSA")
    require_at_jwt: bool = False
    jwks_refresh_cooldown_seconds: float = Field(default=30, ge=1, le=3600)

    @property
    def advertised_scopes(self) -> tuple[str, ...]:
        """The scopes named in the 401 challenge and listed as `scopes_supported`."""
        return self.required_scopes or self.default_scopes


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


class AuditSettings(_Section):
    """`[audit]`: how long lifecycle events are kept (app/audit.py)."""

    retention_days: int = Field(default=90, ge=1, le=3650)
    # an erased user's events this recent stay (for investigations), until the retention ends
    erase_hold_days: int = Field(default=30, ge=0, le=3650)


class AdminSettings(_Section):
    """`[admin]`: the operators' HTTP API (app/integration_api/admin.py); unset, it is off."""

    token: SecretStr | None = None

    @field_validator("token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters (e.g. `openssl rand -hex 32`)")
        return value


class ConnectionSettings(_Section):
    """`[connections]`: connections unused this long are revoked by the housekeeping."""

    max_idle_days: int | None = Field(default=None, ge=1, le=3650)


class LoggingSettings(_Section):
    """`[logging]`: the log lines' format (app/logsetup.py, app/logjson.py)."""

    format: Literal["plain", "json"] = "plain"


class ServiceSettings(_Section):
    """`[services.<name>]`: what a registered sibling server may read beyond its own, and how it
    proves the user it asks for."""

    share_from: tuple[str, ...] = ()  # audiences ("mcp" or service names) it may also read
    display_name: str | None = None
    # "token": the service names no user itself; it sends the user's own access token for
    # `token_audience` and the broker takes the user from it (app/integration_api/user_proof.py)
    user_proof: Literal["off", "token"] = "off"
    # the audience of those tokens at the IdP: the sibling's own resource (its /mcp URL)
    token_audience: str | None = Field(default=None, validate_default=True)

    @field_validator("token_audience")
    @classmethod
    def _token_audience(cls, value: str | None, info: ValidationInfo) -> str | None:
        proof = info.data.get("user_proof")  # absent: user_proof itself is wrong, named there
        if value is None:
            if proof == "token":
                raise ValueError(
                    'required with user_proof = "token": the audience of the sibling\'s own'
                    " access tokens (its /mcp URL)"
                )
            return None
        if proof == "off":
            raise ValueError('only used with user_proof = "token"')
        parts = urlsplit(value)
        if not value.isascii() or not parts.scheme or not (parts.netloc or parts.path):
            raise ValueError("must be an absolute URI, e.g. https://repos.example.com/mcp")
        return value


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
    audit: AuditSettings = field(default_factory=AuditSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    admin: AdminSettings = field(default_factory=AdminSettings)
    connections: ConnectionSettings = field(default_factory=ConnectionSettings)
    webhooks: Mapping[str, WebhookSettings] = field(default_factory=dict)
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


Problem = tuple[str, str]  # (dotted key, what is wrong with it)
MODELS: dict[str, type[_Section]] = {
    "server": ServerSettings,
    "database": DatabaseSettings,
    "identity": IdentitySettings,
    "keys": KeySettings,
    "limits": LimitSettings,
    "audit": AuditSettings,
    "logging": LoggingSettings,
    "admin": AdminSettings,
    "connections": ConnectionSettings,
}


def _validate(raw: dict[str, Any], *, source: str) -> Settings:
    parsed, problems = validate_all(raw)
    if problems:
        raise ConfigError("{}: {}".format(*problems[0]))
    return Settings(source=source, **parsed)


def validate_all(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Problem]]:
    """Every section that parses (keyed as Settings' fields), and every problem found."""
    problems: list[Problem] = []
    for section in sorted(set(raw) - {*SECTIONS, *NAMED_TABLES}):
        problems.append((section, "unknown section" + _suggest(section, [*MODELS, *NAMED_TABLES])))
    parsed: dict[str, Any] = {}
    for name, model in MODELS.items():
        values = _from_text(raw.get(name, {}), model.model_fields, name, problems)
        _parse(model, values, name, parsed, problems)
    providers: dict[str, ProviderSettings] = {}
    for name, values in raw.get("providers", {}).items():
        if not re.fullmatch(NAME_PATTERN, name):
            problems.append((f"providers.{name}", "names are lowercase letters, digits, - and _"))
            continue
        values = _from_text(values, PROVIDER_FIELDS, f"providers.{name}", problems)
        try:
            providers[name] = provider_settings_adapter.validate_python(apply_preset(values))
        except ValidationError as exc:
            problems.extend(_describe(exc, f"providers.{name}", PROVIDER_KEYS))
    services: dict[str, Any] = {}
    for name, values in raw.get("services", {}).items():
        values = _from_text(values, ServiceSettings.model_fields, f"services.{name}", problems)
        _parse(ServiceSettings, values, f"services.{name}", services, problems)
    parsed["providers"] = providers
    parsed["services"] = {name.removeprefix("services."): s for name, s in services.items()}
    parsed["webhooks"] = _webhooks(raw.get("webhooks", {}), problems)
    problems.extend(_token_audience_problems(parsed))
    problems.extend(_retention_problems(parsed))
    return parsed, problems


def _webhooks(raw: dict[str, Any], problems: list[Problem]) -> dict[str, WebhookSettings]:
    webhooks: dict[str, Any] = {}
    for name, values in raw.items():
        if not re.fullmatch(NAME_PATTERN, name):
            problems.append((f"webhooks.{name}", "names are lowercase letters, digits, - and _"))
            continue
        if not isinstance(values, dict):
            problems.append((f"webhooks.{name}", "must be a table ([webhooks.<name>])"))
            continue
        values = _from_text(values, WebhookSettings.model_fields, f"webhooks.{name}", problems)
        _parse(WebhookSettings, values, f"webhooks.{name}", webhooks, problems)
    return {name.removeprefix("webhooks."): hook for name, hook in webhooks.items()}


def _from_text(
    values: Mapping[str, Any], fields: Mapping[str, FieldInfo], prefix: str, problems: list[Problem]
) -> dict[str, Any]:
    """`values`, with each list or table key given as one string (an environment variable, the
    content of a `_file`) made a list or table: a JSON array or object when it starts with `[`
    or `{`, else, for a list, its comma-separated items. A string that cannot be one is a
    problem, and left out."""
    converted = dict(values)
    for key, value in values.items():
        shape = _shape(fields[key].annotation) if key in fields else None
        if shape is None or not isinstance(value, str):
            continue
        text = value.strip()
        if text.startswith(("[", "{")):
            try:
                converted[key] = json.loads(text)
            except json.JSONDecodeError as exc:
                why = f"starts with {text[0]} but is not JSON: {exc.msg}"
                problems.append((f"{prefix}.{key}", why))
                del converted[key]
        elif shape == "list":
            converted[key] = _comma_list(text)
        else:
            problems.append((f"{prefix}.{key}", "must be a table: as one string, a JSON object"))
            del converted[key]
    return converted


def _shape(annotation: Any) -> Literal["list", "table"] | None:
    """What a key of this type is: a list (list, tuple), a table (dict), or neither (None); an
    optional one (`X | None`) as X."""
    origin = get_origin(annotation)
    if origin in (Union, UnionType):
        return next(filter(None, map(_shape, get_args(annotation))), None)
    if origin in (list, tuple, set, frozenset):
        return "list"
    if origin is dict:
        return "table"
    return None


def _comma_list(text: str) -> list[str]:
    """A list given as one string: its comma-separated items."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _retention_problems(parsed: dict[str, Any]) -> list[Problem]:
    """Webhook deliveries are retried for 24 hours: the retention sweep must leave them."""
    audit = parsed.get("audit")
    if parsed["webhooks"] and audit and audit.retention_days < RETENTION_FLOOR_DAYS:
        return [
            (
                "audit.retention_days",
                f"must be at least {RETENTION_FLOOR_DAYS} with webhooks configured (their "
                "events are retried for 24 hours)",
            )
        ]
    return []


def _token_audience_problems(parsed: dict[str, Any]) -> list[Problem]:
    """A token audience names one service, and never the broker's own /mcp: a token for one
    resource must not prove the user to another."""
    problems: list[Problem] = []
    server, identity = parsed.get("server"), parsed.get("identity")
    broker = (identity.audience or f"{server.public_url}/mcp") if server and identity else None
    seen: dict[str, str] = {}
    for name, service in parsed["services"].items():
        audience = service.token_audience
        if audience is None:
            continue
        key = f"services.{name}.token_audience"
        if audience.rstrip("/") == (broker or "").rstrip("/"):
            problems.append((key, "must not be the broker's own audience (its /mcp URL)"))
        elif audience in seen:
            problems.append((key, f"already the token audience of services.{seen[audience]}"))
        seen.setdefault(audience, name)
    return problems


NAME_PATTERN = r"[a-z][a-z0-9_-]{0,31}"
PROVIDER_FIELDS = {**ApiKeyProviderSettings.model_fields, **OAuthProviderSettings.model_fields}
PROVIDER_KEYS = sorted(PROVIDER_FIELDS)


def _parse(
    model: type[BaseModel],
    values: dict[str, Any],
    name: str,
    parsed: dict[str, Any],
    problems: list[Problem],
) -> None:
    try:
        parsed[name] = model.model_validate(values)
    except ValidationError as exc:
        problems.extend(_describe(exc, name, list(model.model_fields)))


def _suggest(word: str, known: list[str]) -> str:
    """' (did you mean 'x'?)' for a close known name, else ''."""
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


PROVIDER_KINDS = ("api_key", "oauth2", "oidc")  # pydantic puts the union tag first in `loc`


def _describe(exc: ValidationError, prefix: str, known: list[str]) -> list[Problem]:
    """Each error of `exc` as (key, message); an unknown key gets the closest of `known`."""
    problems: list[Problem] = []
    for error in exc.errors():
        parts = [str(part) for part in error["loc"] if not isinstance(part, int)]
        if prefix.startswith("providers.") and parts and parts[0] in PROVIDER_KINDS:
            parts = parts[1:]
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            parts, message = ["kind"], "must be one of api_key, oauth2, oidc"
        location = ".".join(parts)
        key = f"{prefix}.{location}" if location else prefix
        if error["type"] == "extra_forbidden":
            message = "unknown key" + (_suggest(parts[-1], known) if len(parts) == 1 else "")
        problems.append((key, message))
    return problems


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
        ConfigError: naming the (first) missing key.
    """
    problems = serve_problems(settings)
    if problems:
        raise ConfigError("{}: {}".format(*problems[0]))


def serve_problems(settings: Settings) -> list[Problem]:
    """What `serve` lacks beyond syntax, each as (key, message)."""
    problems: list[Problem] = []
    identity = settings.identity
    if not identity.issuer:
        problems.append(("identity.issuer", "required (the IdP whose tokens /mcp accepts)"))
    else:
        try:
            validate_public_url(identity.issuer)
        except ValueError as exc:
            problems.append(("identity.issuer", str(exc)))
    if not identity.login_client_id:
        problems.append(("identity.login_client_id", "required (the broker's own login client)"))
    if not settings.keys.signing:
        problems.append(("keys.signing", "at least one key is required"))
    if not settings.keys.encryption:
        problems.append(("keys.encryption", "at least one key is required"))
    return problems
