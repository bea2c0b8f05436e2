"""`connect-broker check-config`: everything `serve` will need, every problem at once.

Beyond what loading the configuration checks (syntax, types, unknown keys with a suggestion), it
asks the database whether it answers and its schema is current, and the IdP whether its discovery
document and JWKS answer. Each problem names the TOML key and the environment variable that sets
it, saying which of the two the value came from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from app.auth.jwks import MAX_DOCUMENT_BYTES
from app.config import (
    MODELS,
    Problem,
    Settings,
    serve_problems,
    validate_all,
)
from app.config_sources import NAMED_TABLES, ConfigError, env_variable, read_raw
from app.migrate import DatabaseUnreachable, schema_problem, url_problem
from app.providers.settings import OAuthProviderSettings

IDP_TIMEOUT_SECONDS = 5


@dataclass(frozen=True)
class Report:
    settings: Settings | None  # None when the configuration does not load
    problems: list[str]


def check(path: Path | None, environ: Mapping[str, str]) -> Report:
    """Every problem of the configuration at `path` with `environ`'s overrides."""
    try:
        raw = read_raw(path, environ, {})
    except ConfigError as exc:
        return Report(None, [str(exc)])
    parsed, found = validate_all(raw)
    failed = {_owner(key) for key, _ in found}
    defaults: dict[str, Any] = {name: model() for name, model in MODELS.items()}
    settings = Settings(source=str(path) if path else "defaults", **{**defaults, **parsed})
    more = serve_problems(settings) + _secret_problems(settings)
    found += [problem for problem in more if _owner(problem[0]) not in failed]
    if "database" not in failed:
        found += _database_problems(settings.database.connect_url())
    if "identity" not in failed and not any(key == "identity.issuer" for key, _ in found):
        found += asyncio.run(_idp_problems(settings.identity.issuer))
    problems = [f"{_origin(key, message, path, environ)}: {message}" for key, message in found]
    return Report(None if problems else settings, problems)


def _owner(key: str) -> str:
    """The section, or provider or service table, that `key` belongs to."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] in NAMED_TABLES else parts[0]


def _origin(key: str, message: str, path: Path | None, environ: Mapping[str, str]) -> str:
    """`key` with where its value came from, or where it can be set."""
    variable = env_variable(key)
    if variable in environ:
        return f"{key} (from {variable})"
    if "." not in key or message.startswith("unknown key"):
        return f"{key} (in {path})"  # an unknown name: only the file has those
    place = f"in {path}" if path else "no config file"
    return f"{key} ({place}; or set {variable})"


def _secret_problems(settings: Settings) -> list[Problem]:
    """Secrets that `serve` accepts missing, but that a sign-in or a connection needs."""
    problems: list[Problem] = []
    identity = settings.identity
    if identity.login_client_id and not identity.login_client_secret.get_secret_value():
        problems.append(
            (
                "identity.login_client_secret",
                "required: the secret the IdP issued for login_client_id (without it, "
                "sign-in fails at the IdP's token endpoint)",
            )
        )
    for name, provider in settings.providers.items():
        if (
            isinstance(provider, OAuthProviderSettings)
            and provider.client_auth_method == "client_secret_basic"
            and not provider.client_secret.get_secret_value()
        ):
            problems.append(
                (
                    f"providers.{name}.client_secret",
                    "required: its token endpoint authenticates the client with HTTP Basic "
                    "(client_auth_method client_secret_basic)",
                )
            )
    return problems


def _database_problems(url: str) -> list[Problem]:
    from app.db import async_url

    problem = url_problem(url)
    if problem is None:
        target = async_url(url)
        file = target.database if target.get_backend_name() == "sqlite" else None
        if file and file != ":memory:" and not Path(file).exists():
            problem = f"the database file {file} does not exist yet; run `connect-broker migrate`"
    if problem is None:
        try:
            problem = schema_problem(url)
        except DatabaseUnreachable as exc:
            problem = f"{exc.problem}; check that the database is running and reachable"
    return [("database.url", problem)] if problem else []


async def _idp_problems(issuer: str) -> list[Problem]:
    """Whether the IdP's discovery document and JWKS answer, as `serve` will fetch them."""
    discovery = f"{issuer.rstrip('/')}/.well-known/openid-configuration"
    async with httpx2.AsyncClient(
        timeout=IDP_TIMEOUT_SECONDS, follow_redirects=False, trust_env=False
    ) as http:
        metadata, problem = await _get_json(http, discovery)
        if metadata is None:
            return [("identity.issuer", f"{problem}; check the issuer URL and the IdP")]
        if metadata.get("issuer") != issuer:
            return [
                (
                    "identity.issuer",
                    f"the IdP names itself {str(metadata.get('issuer'))!r:.200} in {discovery}; "
                    "set identity.issuer to exactly that",
                )
            ]
        jwks_uri = metadata.get("jwks_uri")
        if not isinstance(jwks_uri, str):
            return [("identity.issuer", f"{discovery} has no jwks_uri; is this an OIDC issuer?")]
        document, problem = await _get_json(http, jwks_uri)
    if document is None:
        return [("identity.issuer", f"the IdP's JWKS: {problem}")]
    try:
        keys = KeySet.import_key_set(document)  # type: ignore[arg-type]
    except (JoseError, ValueError, TypeError, KeyError) as exc:
        return [("identity.issuer", f"the IdP's JWKS at {jwks_uri} is unusable ({exc})")]
    if not keys.keys:
        return [("identity.issuer", f"the IdP's JWKS at {jwks_uri} has no keys")]
    return []


async def _get_json(http: httpx2.AsyncClient, url: str) -> tuple[dict[str, object] | None, str]:
    """The JSON object at `url`, or None and why not."""
    try:
        response = await http.get(url, headers={"Accept": "application/json"})
    except httpx2.HTTPError as exc:
        return None, f"{url} did not answer ({type(exc).__name__})"
    if response.status_code != 200:
        return None, f"{url} answered HTTP {response.status_code}"
    if len(response.content) > MAX_DOCUMENT_BYTES:
        return None, f"{url} answered a document over {MAX_DOCUMENT_BYTES} bytes"
    try:
        document = response.json()
    except ValueError:
        return None, f"{url} did not answer JSON"
    if not isinstance(document, dict):
        return None, f"{url} did not answer a JSON object"
    return document, ""
