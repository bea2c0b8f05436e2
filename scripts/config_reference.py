"""Generate docs/configuration.md from the settings models, so the reference cannot drift.

    python -m scripts.config_reference           # rewrite docs/configuration.md
    python -m scripts.config_reference --check   # exit 1 if the file is not what this generates

Keys, types, defaults and environment variables come from the pydantic models (app/config.py,
app/providers/settings.py); what each key means comes from the field's `description` when it
has one, else from MEANINGS below. A key with neither is listed with an empty meaning.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from app.config import (
    AdminSettings,
    AuditSettings,
    ConnectionSettings,
    DatabaseSettings,
    IdentitySettings,
    KeySettings,
    LimitSettings,
    LoggingSettings,
    ServerSettings,
    ServiceSettings,
)
from app.providers.presets import PRESETS
from app.providers.settings import (
    ApiKeyProviderSettings,
    ApiKeyValidation,
    OAuthProviderSettings,
)
from app.webhooks.settings import WebhookSettings

TARGET = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

# (table heading, dotted prefix, environment prefix or None when the environment cannot set it)
TABLES: tuple[tuple[str, type[BaseModel], str, str | None], ...] = (
    ("`[server]`", ServerSettings, "server", "BROKER_SERVER_"),
    ("`[database]`", DatabaseSettings, "database", "BROKER_DATABASE_"),
    ("`[identity]`", IdentitySettings, "identity", "BROKER_IDENTITY_"),
    ("`[keys]`", KeySettings, "keys", "BROKER_KEYS_"),
    ("`[limits]`", LimitSettings, "limits", "BROKER_LIMITS_"),
    ("`[audit]`", AuditSettings, "audit", "BROKER_AUDIT_"),
    ("`[logging]`", LoggingSettings, "logging", "BROKER_LOGGING_"),
    ("`[admin]`", AdminSettings, "admin", "BROKER_ADMIN_"),
    ("`[connections]`", ConnectionSettings, "connections", "BROKER_CONNECTIONS_"),
    (
        '`[providers.<name>]` with `kind = "api_key"`',
        ApiKeyProviderSettings,
        "providers.<name>",
        "BROKER_PROVIDERS_<NAME>_",
    ),
    (
        "`[providers.<name>.validation]` (API keys)",
        ApiKeyValidation,
        "providers.<name>.validation",
        None,
    ),
    (
        '`[providers.<name>]` with `kind = "oauth2"` or `"oidc"`, or a `preset`',
        OAuthProviderSettings,
        "providers.<name>",
        "BROKER_PROVIDERS_<NAME>_",
    ),
    ("`[services.<name>]`", ServiceSettings, "services.<name>", "BROKER_SERVICES_<NAME>_"),
    ("`[webhooks.<name>]`", WebhookSettings, "webhooks.<name>", "BROKER_WEBHOOKS_<NAME>_"),
)

MEANINGS: dict[str, str] = {
    "server.public_url": "canonical URL; every URL the broker emits is built from it. https "
    "unless the host is loopback; no user info, query, fragment, non-ASCII or `xn--` host",
    "server.allowed_origins": "extra browser origins (`https://host[:port]`) allowed on `/mcp`; "
    "the public origin always is, and their hosts are accepted too. Any other `Host` gets 421, "
    "except on `/healthz`, `/readyz` and `/metrics`",
    "server.retry_wait_seconds": "how long a client's retry waits for the browser flow to finish "
    "before the same link is issued again",
    "server.flow_ttl_seconds": "life of a connect link (and of its `requestState`)",
    "server.max_body_bytes": "largest `/mcp` request body; beyond it, 413",
    "server.max_api_body_bytes": "largest request body on `/api/v1` and the browser forms "
    "(1 KiB to 16 MiB), counted as it arrives, chunked or not; beyond it, 413. `/api/v1` "
    "checks the service secret before it reads any body",
    "server.header_timeout_seconds": "a connection must finish sending each request's headers "
    "within this many seconds (from connecting, or from the first byte of a later request on a "
    "kept-alive connection), or it is closed (`serve` only)",
    "server.max_connections": "open connections one process keeps; one more is answered 503 "
    "with `Retry-After: 1` and closed (`serve` only). Keep it under the process's descriptor "
    "limit (`ulimit -n`)",
    "server.docs_url": "absolute http(s) URL of your documentation, linked from the landing "
    "page at `/`",
    "server.login_max_age_seconds": "a browser sign-in older than this must sign in again",
    "server.session_ttl_seconds": "life of a browser session at the broker",
    "server.metrics_token": "bearer token (32+ characters) a scrape of `/metrics` must present; "
    "unset, `/metrics` answers 404",
    "database.url": "`sqlite:///path` or `postgresql://user@host/db`; the driver is picked for you",
    "database.password": "PostgreSQL's password, merged into `url` only where connections open "
    "(use `password_file` with a secrets file); not with a password in `url`",
    "database.pool_size": "database connections per process: this many (and as many again as "
    "overflow) for SQLAlchemy, and on PostgreSQL up to this many for the hot-path statements",
    "identity.issuer": "required by `serve`: the OpenID provider whose JWT access tokens `/mcp` "
    "accepts (discovery and JWKS). Write it exactly as the IdP's discovery document names it: a "
    "document naming another issuer, or an endpoint that is not https (or http to a loopback "
    "host), is refused and logged as `jwks.metadata_refused`",
    "identity.audience": "required `aud` of access tokens; empty means `<public_url>/mcp`",
    "identity.identity_claim": "claim naming the user (`oid` for Entra ID); never an email",
    "identity.login_client_id": "required by `serve`: the broker's own login client at the "
    "identity provider",
    "identity.login_client_secret": "its secret",
    "identity.default_scopes": "scopes the 401 challenge and the resource metadata name when "
    "`required_scopes` is empty",
    "identity.required_scopes": "scopes every access token must carry (else 403 "
    "`insufficient_scope`)",
    "identity.algorithms": "JWS algorithms accepted on access tokens (and the login's ID "
    "tokens, and the services' user proofs): at least one, each an asymmetric signature, "
    "`RS256`, `RS384`, `RS512`, `PS256`, `PS384`, `PS512`, `ES256`, `ES384`, `ES512` or "
    "`EdDSA`. `none` and the HMAC ones (`HS256`, …) are refused: anyone could make such a token",
    "identity.require_at_jwt": "accept only tokens whose header says `typ: at+jwt` (RFC 9068 "
    "access tokens): turn it on when the IdP issues them, so that no other JWT it "
    "signs (an ID token, a logout token) passes for an access token even with a matching "
    "audience. The development IdP and node `oidc-provider` issue them",
    "identity.jwks_refresh_cooldown_seconds": "a token signed with a key id the cached JWKS "
    "lacks refetches it at most once in this time (the last good keys stay in use meanwhile): "
    "shorter picks up a rotated key sooner, longer bounds what a flood of made-up key ids costs "
    "the identity provider",
    "keys.signing": 'required by `serve`: `"<key-id>:<base64url of 32 bytes>"` keys that sign '
    "`requestState` and key the digests of browser sessions, CSRF tokens, OAuth `state` and "
    "service secrets; the first is active, the others still verify",
    "keys.encryption": "required by `serve`: keys sealing stored credentials (AES-GCM); the "
    "first seals, all open (`connect-broker keys rotate` re-seals with the first)",
    "limits.user_requests_per_minute": "MCP requests one user (issuer + subject) may make a "
    "minute, per process; past it, 429 and JSON-RPC `-31029`. `0`: no limit",
    "limits.user_burst": "requests one user may make at once",
    "limits.failed_auths_per_minute": "wrong credentials (access tokens, service secrets) one "
    "client address (IPv6: its /64) may present a minute, per process; past it, 429. `0`: no "
    "limit",
    "limits.failed_auth_burst": "wrong credentials one address may present at once",
    "logging.format": "`plain`: one text line per record; `json`: one JSON object per line, "
    "access lines included (fields in [operations](operations.md#logs)); `serve` and `dev` "
    "(from `dev --config FILE`, or the environment)",
    "audit.erase_hold_days": "an erasure (`users erase`, `DELETE /api/v1/admin/users`) keeps "
    "the user's audit events of the last this many days, for investigations; the retention "
    "sweep deletes them later. `0`: every event of the user goes",
    "admin.token": "bearer token (32+ characters) of the operators' HTTP API under "
    "`/api/v1/admin` (`token_file` for a mounted file); unset, that API answers 404",
    "connections.max_idle_days": "connections neither used nor connected again by their user "
    "for this many whole days are revoked (revocation queued) and deleted by the housekeeping, "
    "with a `connection.idle_revoked` audit event; unset: never",
    "audit.retention_days": "audit events older than this many days (1 to 3650) are deleted by the "
    "housekeeping sweep (every minute, in each process); `connect-broker audit list` shows them",
    "providers.<name>.kind": "`api_key`, `oauth2` or `oidc` (a `preset` supplies it)",
    "providers.<name>.display_name": "the provider's name on pages and in tool results",
    "providers.<name>.label": "the label of the key's input field",
    "providers.<name>.help_url": "a link on the key page to where users find their key",
    "providers.<name>.pattern": "regular expression a key must match",
    "providers.<name>.validation": "optional probe request: a key is accepted when it answers 2xx",
    "providers.<name>.validation.url": "the probe's URL (https unless loopback)",
    "providers.<name>.validation.method": "its method",
    "providers.<name>.validation.header": "the header carrying the key: `Name: template` with "
    "`{api_key}` once",
    "providers.<name>.validation.timeout_seconds": "the probe's deadline",
    "providers.<name>.preset": "start from a built-in provider (see below); every key given "
    "overrides the preset's",
    "providers.<name>.client_id": "the broker's OAuth app at the provider; register "
    "`<public_url>/oauth/<name>/callback` there",
    "providers.<name>.client_secret": "its secret (`client_secret_file` for a mounted file)",
    "providers.<name>.authorize_url": "authorization endpoint (`oidc`: discovered when omitted)",
    "providers.<name>.token_url": "token endpoint (`oidc`: discovered when omitted)",
    "providers.<name>.userinfo_url": "where the account label is read",
    "providers.<name>.revocation_url": "RFC 7009 revocation endpoint, called on disconnect",
    "providers.<name>.revocation": "`rfc7009`, `github` (its grant API) or `none`",
    "providers.<name>.issuer": "`oidc` only: discovery, ID-token checks (issuer, audience, "
    "nonce), RFC 9207 `iss` check; its discovery document must name exactly this issuer, and "
    "https (or loopback) endpoints",
    "providers.<name>.api_base_url": "base URL of the provider's API, for tools that call it",
    "providers.<name>.scopes": "scopes asked for by default (`oidc` must include `openid`)",
    "providers.<name>.scope_separator": "how scopes are joined in the authorize request",
    "providers.<name>.scope_parameter": "the authorize request's parameter carrying the scopes",
    "providers.<name>.pkce": "send a PKCE S256 challenge",
    "providers.<name>.client_auth_method": "how the token endpoint authenticates the broker",
    "providers.<name>.account_label_claim": 'member (dotted) holding "Connected as …"',
    "providers.<name>.account_label_prefix": "text put before the label (`@` for GitHub)",
    "providers.<name>.account_id_claim": "member (dotted) of the same document holding the "
    "account's id at the provider (tells several accounts apart; OpenID: the ID token's `sub`)",
    "providers.<name>.authorize_params": "extra authorize request parameters",
    "providers.<name>.token_types": "`token_type`s accepted (compared lower-case)",
    "providers.<name>.token_member": "member of the token response holding the token (none: "
    "the response itself; a response without it is read at the top level)",
    "providers.<name>.timeout_seconds": "total deadline of each call to the provider",
    "services.<name>.share_from": 'audiences (`"mcp"` or service names) whose connections this '
    "service may also read",
    "services.<name>.display_name": "how pages name the service; default: its name",
    "services.<name>.user_proof": "`off`: the service names the user it verified; `token`: it "
    "sends the user's own access token instead, the broker takes the user from it, and the "
    "routes that name the user refuse the service ([integration-api.md](integration-api.md), "
    "*Proof of the user*)",
    "services.<name>.token_audience": 'required with `user_proof = "token"`, else refused: the '
    "audience those tokens carry, the sibling's own resource at the IdP (its `/mcp` URL); not the "
    "broker's audience, and not another service's",
    "webhooks.<name>.url": "absolute http(s) URL (no user info) each event is posted to, signed "
    "([webhooks.md](webhooks.md)); with webhooks, `audit.retention_days` must be at least 2",
    "webhooks.<name>.secret_file": "file holding the HMAC secret (16+ characters, e.g. `openssl "
    "rand -hex 32`); the secret is read from a file only, a missing or empty file is refused",
    "webhooks.<name>.events": 'event names to post (those of the audit events), or `"*"` for all',
}

HEADER = """\
# Configuration reference

<!-- Generated by `python -m scripts.config_reference` from the settings models; do not edit.
     tests/test_docs.py fails when this file and the models disagree. -->

The broker reads one TOML file: `--config PATH` (before the command), else `$BROKER_CONFIG`,
else `./broker.toml` if present. `broker.example.toml` is a commented starting point;
`connect-broker --config broker.toml check-config` validates it, and a bad value stops
`check-config` and `serve` with a message naming the key.

- Every key can be overridden from the environment: `BROKER_<SECTION>_<KEY>`, e.g.
  `BROKER_DATABASE_URL`. For a provider, service or webhook the variable is
  `BROKER_PROVIDERS_<NAME>_<KEY>` (`BROKER_SERVICES_<NAME>_<KEY>`,
  `BROKER_WEBHOOKS_<NAME>_<KEY>`), and the table `[providers.<name>]` must exist in the file.
- A list key (type `tuple[…]`) given as one string, from the environment or a `_file`, is a
  JSON array when it starts with `[` (`["a,b", "c"]`, for items holding a comma), else
  comma-separated (`BROKER_PROVIDERS_GH_TOKEN_TYPES=bearer,mac`). A table key (type `dict[…]`,
  `authorize_params`) is a JSON object: `BROKER_PROVIDERS_GH_AUTHORIZE_PARAMS='{"prompt":
  "consent"}'`. An API key's `validation` table is set in the file only.
- A key ending in `_file` reads the value of the key without the suffix from that file (for
  mounted secrets): `client_secret_file = "/run/secrets/github"`, or
  `BROKER_IDENTITY_LOGIN_CLIENT_SECRET_FILE`. The environment wins over the file either way:
  `BROKER_PROVIDERS_GH_CLIENT_SECRET` over both `client_secret` and `client_secret_file` in
  the file, `BROKER_PROVIDERS_GH_CLIENT_SECRET_FILE` over both as well; setting both variables is
  an error. A webhook's `secret_file` is its own key: its secret can only come from a file.
- `serve` also needs `identity.issuer`, `identity.login_client_id` and at least one key in each
  of `keys.signing` and `keys.encryption` (`connect-broker keys generate` prints them).
"""


@dataclass(frozen=True)
class Row:
    key: str
    env: str
    type: str
    default: str
    meaning: str


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return " / ".join(str(value) for value in get_args(annotation))
    if get_origin(annotation) in (Union, UnionType):
        return " \\| ".join(_type_name(member) for member in get_args(annotation))
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation.__name__
    text = repr(annotation)
    for noise in ("typing.", "app.providers.settings.", "pydantic.types."):
        text = text.replace(noise, "")
    return text


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined or value is None:
        return "none"
    if isinstance(value, SecretStr):
        return "empty" if not value.get_secret_value() else "(secret)"
    if isinstance(value, str) and value and not value.strip():
        return f'`"{value}"`'
    if isinstance(value, str | tuple | list | dict) and not value:
        return "empty"
    if isinstance(value, tuple):
        return ", ".join(f"`{item}`" for item in value)
    return f"`{value}`"


def rows(model: type[BaseModel], prefix: str, env_prefix: str | None) -> list[Row]:
    found: list[Row] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}.{name}"
        env = f"`{env_prefix}{name.upper()}`" if env_prefix else "file only"
        if get_args(info.annotation) and ApiKeyValidation in get_args(info.annotation):
            env = "file only"
        meaning = info.description or MEANINGS.get(key, "")
        found.append(Row(f"`{key}`", env, _type_name(info.annotation), _default(info), meaning))
    return found


def _table(found: list[Row]) -> list[str]:
    lines = ["| key | environment | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for row in found:
        cells = (row.key, row.env, f"`{row.type}`", row.default, row.meaning)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _presets() -> list[str]:
    lines = [
        "## Provider presets",
        "",
        '`preset = "<name>"` fills these keys; any key in the table overrides them.',
        "",
        "| preset | kind | default scopes | what it fills |",
        "| --- | --- | --- | --- |",
    ]
    for name, values in PRESETS.items():
        scopes = ", ".join(f"`{scope}`" for scope in values.get("scopes", [])) or "none"
        filled = ", ".join(f"`{key}`" for key in values if key not in ("kind", "scopes"))
        lines.append(f"| `{name}` | `{values['kind']}` | {scopes} | {filled} |")
    return lines


def render() -> str:
    lines = [HEADER]
    for heading, model, prefix, env_prefix in TABLES:
        lines += [f"## {heading}", "", *_table(rows(model, prefix, env_prefix)), ""]
    lines += _presets()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            sys.stderr.write(f"{TARGET} is out of date: run python -m scripts.config_reference\n")
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
