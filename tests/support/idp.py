"""Test helpers around a real OpenID Connect provider (node ``oidc-provider``).

The IdP lives in ``tests/idp/server.mjs`` (install it once with ``npm ci --prefix tests/idp``).
These helpers start it, forge tokens with its signing key, and drive its login pages the way a
browser would (cookie jar, manual redirects) so tests need no browser.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx2
from joserfc import jws
from joserfc.jwk import RSAKey

from .http import local_client

__all__ = [
    "IDP_DIR",
    "IDP_SERVER",
    "IdpConfig",
    "IdpError",
    "IdpProcess",
    "client_metadata",
    "discover",
    "exchange_code",
    "free_port",
    "generate_rsa_jwk",
    "idp_login",
    "mint_token",
    "obtain_access_token",
    "obtain_tokens",
    "pkce_pair",
    "public_jwk",
    "running_idp",
    "start_idp",
    "unverified_jwt",
]

IDP_DIR: Path = Path(__file__).resolve().parent.parent / "idp"
IDP_SERVER: Path = IDP_DIR / "server.mjs"

START_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
MAX_LOGIN_STEPS = 20

TokenAuth = Literal["client_secret_basic", "client_secret_post"]
_BASIC: TokenAuth = "client_secret_basic"


class IdpError(RuntimeError):
    """The IdP could not be started or did not behave as the test flow expected."""


# --------------------------------------------------------------------------------------------
# Keys and configuration
# --------------------------------------------------------------------------------------------


def generate_rsa_jwk(kid: str) -> dict[str, Any]:
    """A fresh private RSA-2048 JWK (dict) with ``kid``, ``alg: RS256`` and ``use: sig``."""
    key = RSAKey.generate_key(
        2048, parameters={"kid": kid, "alg": "RS256", "use": "sig"}, private=True
    )
    jwk = dict(key.as_dict(private=True))
    jwk.update({"kid": kid, "alg": "RS256", "use": "sig"})
    return jwk


def public_jwk(jwk: dict[str, Any]) -> dict[str, Any]:
    """The public half of an RSA JWK dict."""
    return {k: v for k, v in jwk.items() if k in ("kty", "n", "e", "kid", "alg", "use")}


# Listening ports are drawn below the kernel's ephemeral range (32768-60999 by default): a port
# from bind(0) lies inside it, where any outgoing connection (a test's HTTP client, a database
# connection) may take it as its local port between the check and the server's own bind.
ALL_LISTEN_PORTS = range(20000, 32768)
PORT_SLOTS = 8


def listen_ports(environ: Mapping[str, str]) -> range:
    """This test process's own slice of ALL_LISTEN_PORTS (one of eight: up to four xdist
    workers on each database). `scripts/test.sh` runs four test processes at once; two drawing
    from one range could both find a port free and both start a server on it."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return ALL_LISTEN_PORTS
    slot = (int(worker[2:]) * 2 + (environ.get("BROKER_TEST_DB") == "postgresql")) % PORT_SLOTS
    size = len(ALL_LISTEN_PORTS) // PORT_SLOTS
    return range(ALL_LISTEN_PORTS.start + slot * size, ALL_LISTEN_PORTS.start + (slot + 1) * size)


LISTEN_PORTS = listen_ports(os.environ)
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago and that this process has not handed
    out before, drawn at random so parallel test processes rarely meet."""
    for _ in range(200):
        port = secrets.choice(LISTEN_PORTS)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {LISTEN_PORTS.start}-{LISTEN_PORTS.stop - 1}")


def client_metadata(
    client_id: str,
    redirect_uris: list[str],
    *,
    client_secret: str | None = None,
    token_endpoint_auth_method: str | None = None,
    grant_types: tuple[str, ...] = ("authorization_code", "refresh_token"),
) -> dict[str, Any]:
    """Client metadata for :attr:`IdpConfig.clients`.

    Without a secret the client is public (``token_endpoint_auth_method: none``, PKCE required).
    """
    method = token_endpoint_auth_method or (
        "client_secret_basic" if client_secret is not None else "none"
    )
    meta: dict[str, Any] = {
        "client_id": client_id,
        "redirect_uris": list(redirect_uris),
        "grant_types": list(grant_types),
        "response_types": ["code"],
        "token_endpoint_auth_method": method,
    }
    if client_secret is not None:
        meta["client_secret"] = client_secret
    return meta


def _default_jwks() -> dict[str, Any]:
    return {"keys": [generate_rsa_jwk(f"idp-{secrets.token_hex(4)}")]}


def _default_cookie_prefix() -> str:
    return f"idp{secrets.token_hex(3)}"


@dataclass
class IdpConfig:
    """Mirror of the JSON config read by ``tests/idp/server.mjs``.

    ``port=0`` picks a free port at start time; ``issuer=None`` means ``http://127.0.0.1:<port>``.
    """

    port: int = 0
    issuer: str | None = None
    jwks: dict[str, Any] = field(default_factory=_default_jwks)
    resources: list[str] = field(default_factory=list)
    access_token_ttl: int = 600
    clients: list[dict[str, Any]] = field(default_factory=list)
    cookie_prefix: str = field(default_factory=_default_cookie_prefix)
    extra_claims: dict[str, dict[str, Any]] = field(default_factory=dict)
    pairwise_access_sub: bool = False

    @property
    def signing_jwk(self) -> dict[str, Any]:
        """The first (signing) private JWK."""
        keys: list[dict[str, Any]] = self.jwks["keys"]
        return keys[0]

    def resolved(self) -> IdpConfig:
        """A copy with a concrete port and issuer."""
        port = self.port or free_port()
        issuer = self.issuer or f"http://127.0.0.1:{port}"
        return IdpConfig(
            port=port,
            issuer=issuer,
            jwks=self.jwks,
            resources=list(self.resources),
            access_token_ttl=self.access_token_ttl,
            clients=[dict(c) for c in self.clients],
            cookie_prefix=self.cookie_prefix,
            extra_claims={k: dict(v) for k, v in self.extra_claims.items()},
            pairwise_access_sub=self.pairwise_access_sub,
        )

    def to_json(self) -> dict[str, Any]:
        if not self.port or not self.issuer:
            raise ValueError("call resolved() first: port and issuer must be concrete")
        return {
            "port": self.port,
            "issuer": self.issuer,
            "jwks": self.jwks,
            "resources": self.resources,
            "access_token_ttl": self.access_token_ttl,
            "clients": self.clients,
            "cookie_prefix": self.cookie_prefix,
            "extra_claims": self.extra_claims,
            "pairwise_access_sub": self.pairwise_access_sub,
        }


# --------------------------------------------------------------------------------------------
# Process management
# --------------------------------------------------------------------------------------------


class IdpProcess:
    """A running ``server.mjs``. Use as a context manager or call :meth:`stop`."""

    def __init__(
        self,
        config: IdpConfig,
        process: subprocess.Popen[bytes],
        log_path: Path,
        config_path: Path,
    ) -> None:
        self.config = config
        self.process = process
        self.log_path = log_path
        self.config_path = config_path
        assert config.issuer is not None
        self.issuer: str = config.issuer
        self.port: int = config.port

    @property
    def signing_jwk(self) -> dict[str, Any]:
        return self.config.signing_jwk

    @property
    def jwks_uri(self) -> str:
        return f"{self.issuer}/jwks"

    @property
    def discovery_url(self) -> str:
        return f"{self.issuer}/.well-known/openid-configuration"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """SIGTERM, wait up to 5 s, then SIGKILL. Idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT)

    def __enter__(self) -> IdpProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"IdpProcess(issuer={self.issuer!r}, pid={self.process.pid})"


def start_idp(config: IdpConfig, workdir: Path, *, timeout: float = START_TIMEOUT) -> IdpProcess:
    """Write the config JSON into ``workdir``, start the IdP, wait for ``READY <issuer>``.

    Output goes to ``workdir/idp-<prefix>-<port>.log``; on failure :class:`IdpError` carries it.
    """
    node = shutil.which("node")
    if node is None:
        raise IdpError("`node` is not on PATH; the test IdP needs Node.js")
    if not (IDP_DIR / "node_modules" / "oidc-provider").is_dir():
        raise IdpError(
            f"oidc-provider is not installed in {IDP_DIR}; run `npm ci --prefix {IDP_DIR}`"
        )
    resolved = config.resolved()
    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"idp-{resolved.cookie_prefix}-{resolved.port}"
    config_path = workdir / f"{stem}.json"
    log_path = workdir / f"{stem}.log"
    config_path.write_text(json.dumps(resolved.to_json(), indent=2))

    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [node, str(IDP_SERVER), str(config_path)],
            cwd=str(IDP_DIR),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "NODE_ENV": "test"},
        )
    idp = IdpProcess(resolved, process, log_path, config_path)

    ready_line = f"READY {resolved.issuer}"
    deadline = time.monotonic() + timeout
    while True:
        if any(line.strip() == ready_line for line in idp.log().splitlines()):
            return idp
        if process.poll() is not None:
            raise IdpError(
                f"test IdP exited with code {process.returncode} before becoming ready "
                f"({resolved.issuer}); output from {log_path}:\n{idp.log()}"
            )
        if time.monotonic() > deadline:
            idp.stop()
            raise IdpError(
                f"test IdP did not print {ready_line!r} within {timeout:.0f}s; "
                f"output from {log_path}:\n{idp.log()}"
            )
        time.sleep(0.05)


@contextlib.contextmanager
def running_idp(config: IdpConfig, workdir: Path) -> Iterator[IdpProcess]:
    """``with running_idp(cfg, tmp_path) as idp:`` — start, yield, always stop."""
    idp = start_idp(config, workdir)
    try:
        yield idp
    finally:
        idp.stop()


# --------------------------------------------------------------------------------------------
# Tokens
# --------------------------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(data: str) -> bytes:
    return base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))


def unverified_jwt(token: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, claims) of a compact JWS without verifying anything."""
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError(f"not a compact JWS (has {len(parts)} parts)")
    header: dict[str, Any] = json.loads(_b64url_decode(parts[0]))
    claims: dict[str, Any] = json.loads(_b64url_decode(parts[1]))
    return header, claims


@functools.lru_cache(maxsize=32)
def _imported_key(serialized: str) -> RSAKey:
    """Importing (and validating) an RSA key is slow; tests mint many tokens with one key."""
    return RSAKey.import_key(json.loads(serialized))


def mint_token(
    jwk: dict[str, Any],
    *,
    issuer: str,
    audience: str | list[str],
    subject: str | None,
    client_id: str = "mcp-client",
    scope: str = "mcp:tools",
    lifetime: int = 300,
    extra: dict[str, Any] | None = None,
    header: dict[str, Any] | None = None,
    omit: tuple[str, ...] = (),
) -> str:
    """Sign an RFC 9068-style access token with ``jwk`` (normally the IdP's own key).

    Claims: iss, sub (left out when ``subject`` is None), aud, exp (now + lifetime; negative
    lifetime gives an expired token), iat, nbf, jti, client_id, scope; ``extra`` adds/overrides
    claims, ``omit`` removes claims by name. Header: ``{"alg": "RS256", "typ": "at+jwt",
    "kid": jwk["kid"]}`` updated by ``header``; a ``None`` value removes that header field.
    ``alg: "none"`` produces an unsigned token (empty signature).
    """
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": issuer,
        "sub": subject,
        "aud": audience,
        "exp": now + lifetime,
        "iat": now,
        "nbf": now,
        "jti": secrets.token_urlsafe(16),
        "client_id": client_id,
        "scope": scope,
    }
    if subject is None:
        del claims["sub"]
    if extra:
        claims.update(extra)
    for name in omit:
        claims.pop(name, None)

    protected: dict[str, Any] = {"alg": "RS256", "typ": "at+jwt"}
    if "kid" in jwk:
        protected["kid"] = jwk["kid"]
    if header:
        protected.update(header)
    protected = {k: v for k, v in protected.items() if v is not None}

    payload = json.dumps(claims, separators=(",", ":")).encode()
    alg = protected.get("alg")
    if alg == "none":
        head = json.dumps(protected, separators=(",", ":")).encode()
        return f"{_b64url(head)}.{_b64url(payload)}."
    key = _imported_key(json.dumps(jwk, sort_keys=True))
    algorithms = [alg] if isinstance(alg, str) else None
    return jws.serialize_compact(protected, payload, key, algorithms=algorithms)


# --------------------------------------------------------------------------------------------
# Browser emulation
# --------------------------------------------------------------------------------------------


def pkce_pair() -> tuple[str, str]:
    """(code_verifier, S256 code_challenge)."""
    verifier = secrets.token_urlsafe(48)
    challenge = _b64url(hashlib.sha256(verifier.encode("ascii")).digest())
    return verifier, challenge


class _FormParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.forms: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: (v or "") for k, v in attrs}
        if tag == "form":
            self._current = {
                "action": a.get("action", ""),
                "method": a.get("method", "get").lower(),
                "fields": {},
            }
            self.forms.append(self._current)
        elif tag == "input" and self._current is not None and a.get("name"):
            self._current["fields"][a["name"]] = a.get("value", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._current = None


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


async def idp_login(
    client: httpx2.AsyncClient, authorize_url: str, *, user: str
) -> httpx2.Response:
    """Drive the IdP from ``authorize_url`` as a browser would, logging in as ``user``.

    Follows redirects that stay on the IdP's origin, submits the devInteractions login form
    (login=user, any password), the consent form if shown (only with ``prompt=consent``) and
    self-submitting pages such as the logout confirmation on an account switch. Returns the
    first response that redirects away from the IdP (normally to the relying party's
    redirect_uri, carrying ``code`` or ``error``) without following it. Cookies accumulate in
    ``client``.
    """
    idp_origin = _origin(authorize_url)
    url = authorize_url
    method = "GET"
    data: dict[str, str] | None = None
    for _ in range(MAX_LOGIN_STEPS):
        if method == "GET":
            resp = await client.get(url, follow_redirects=False)
        else:
            resp = await client.post(url, data=data, follow_redirects=False)
        if resp.is_redirect:
            location = urljoin(str(resp.url), resp.headers["location"])
            if _origin(location) != idp_origin:
                return resp
            url, method, data = location, "GET", None
            continue
        if resp.status_code == 200 and "text/html" in resp.headers.get("content-type", ""):
            parser = _FormParser()
            parser.feed(resp.text)
            form = next((f for f in parser.forms if f["method"] == "post"), None)
            if form is None:
                raise IdpError(f"IdP page at {resp.url} has no form:\n{resp.text[:2000]}")
            fields: dict[str, str] = dict(form["fields"])
            prompt = fields.get("prompt")
            if prompt == "login":
                fields.update({"login": user, "password": "any-password"})
            elif prompt != "consent" and "forms[0].submit()" not in resp.text:
                # Auto-submitting pages (e.g. the logout confirmation oidc-provider inserts when
                # a different account logs in) are posted as-is; anything else is unexpected.
                raise IdpError(f"unexpected IdP page at {resp.url}:\n{resp.text[:2000]}")
            url = urljoin(str(resp.url), form["action"])
            if _origin(url) != idp_origin:
                raise IdpError(f"IdP page at {resp.url} posts to {url} (form_post unsupported)")
            method, data = "POST", fields
            continue
        raise IdpError(
            f"IdP answered {resp.status_code} for {method} {resp.url}:\n{resp.text[:2000]}"
        )
    raise IdpError(f"IdP login did not leave the IdP within {MAX_LOGIN_STEPS} steps")


async def discover(issuer: str, client: httpx2.AsyncClient | None = None) -> dict[str, Any]:
    """The IdP's OpenID discovery document."""
    url = f"{issuer.rstrip('/')}/.well-known/openid-configuration"
    if client is None:
        async with local_client(timeout=10.0) as own:
            resp = await own.get(url)
    else:
        resp = await client.get(url)
    resp.raise_for_status()
    doc: dict[str, Any] = resp.json()
    return doc


def _code_from_redirect(response: httpx2.Response, redirect_uri: str, state: str) -> str:
    location = response.headers["location"]
    if not location.startswith(redirect_uri):
        raise IdpError(f"IdP redirected to {location!r}, expected {redirect_uri!r}")
    query = parse_qs(urlsplit(location).query)
    if "error" in query:
        raise IdpError(f"authorization failed: {query}")
    if query.get("state") != [state]:
        raise IdpError(f"state mismatch in {location!r}")
    return query["code"][0]


async def exchange_code(
    http: httpx2.AsyncClient,
    token_endpoint: str,
    *,
    code: str,
    code_verifier: str,
    client_id: str,
    client_secret: str | None,
    redirect_uri: str,
    resource: str | None,
    token_auth: TokenAuth = _BASIC,
) -> dict[str, Any]:
    """Token request for an authorization code; returns the token response JSON."""
    form: dict[str, str] = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": redirect_uri,
        "code_verifier": code_verifier,
    }
    if resource is not None:
        form["resource"] = resource
    if client_secret is None:
        form["client_id"] = client_id
        resp = await http.post(token_endpoint, data=form)
    elif token_auth == "client_secret_post":
        form.update({"client_id": client_id, "client_secret": client_secret})
        resp = await http.post(token_endpoint, data=form)
    else:
        resp = await http.post(token_endpoint, data=form, auth=(client_id, client_secret))
    if resp.status_code != 200:
        raise IdpError(f"token request failed ({resp.status_code}): {resp.text}")
    tokens: dict[str, Any] = resp.json()
    return tokens


async def obtain_tokens(
    issuer: str,
    *,
    user: str,
    client_id: str,
    client_secret: str | None,
    redirect_uri: str,
    resource: str | None,
    scope: str = "openid mcp:tools",
    token_auth: TokenAuth = _BASIC,
    http: httpx2.AsyncClient | None = None,
    extra_params: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run authorization code + PKCE (S256) against the IdP; return the token response JSON.

    ``resource=None`` sends no resource indicator (plain OIDC login: opaque access token).
    Pass ``http`` to reuse a cookie jar (e.g. to test SSO); otherwise a fresh client is used.
    ``extra_params`` are added to the authorization request (e.g. ``{"prompt": "login"}``).
    The code is taken from the redirect's Location; redirect_uri is never requested.
    """
    if http is None:
        async with local_client(timeout=10.0) as own:
            return await obtain_tokens(
                issuer,
                user=user,
                client_id=client_id,
                client_secret=client_secret,
                redirect_uri=redirect_uri,
                resource=resource,
                scope=scope,
                token_auth=token_auth,
                http=own,
                extra_params=extra_params,
            )

    meta = await discover(issuer, http)
    verifier, challenge = pkce_pair()
    state = secrets.token_urlsafe(16)
    params: dict[str, str] = {
        "response_type": "code",
        "client_id": client_id,
        "redirect_uri": redirect_uri,
        "scope": scope,
        "state": state,
        "code_challenge": challenge,
        "code_challenge_method": "S256",
    }
    if "openid" in scope.split():
        params["nonce"] = secrets.token_urlsafe(16)
    if resource is not None:
        params["resource"] = resource
    params.update(extra_params or {})
    authorize_url = f"{meta['authorization_endpoint']}?{urlencode(params)}"

    final = await idp_login(http, authorize_url, user=user)
    code = _code_from_redirect(final, redirect_uri, state)
    return await exchange_code(
        http,
        meta["token_endpoint"],
        code=code,
        code_verifier=verifier,
        client_id=client_id,
        client_secret=client_secret,
        redirect_uri=redirect_uri,
        resource=resource,
        token_auth=token_auth,
    )


async def obtain_access_token(
    issuer: str,
    *,
    user: str,
    client_id: str,
    client_secret: str | None,
    redirect_uri: str,
    resource: str,
    scope: str = "openid mcp:tools",
    token_auth: TokenAuth = _BASIC,
) -> str:
    """A real RFC 9068 JWT access token for ``resource`` issued by the IdP to ``user``."""
    tokens = await obtain_tokens(
        issuer,
        user=user,
        client_id=client_id,
        client_secret=client_secret,
        redirect_uri=redirect_uri,
        resource=resource,
        scope=scope,
        token_auth=token_auth,
    )
    access_token = tokens.get("access_token")
    if not isinstance(access_token, str):
        raise IdpError(f"token response has no access_token: {tokens}")
    try:
        _, claims = unverified_jwt(access_token)
    except ValueError as exc:
        raise IdpError(f"access token is not a JWT: {access_token!r}") from exc
    aud = claims.get("aud")
    if aud != resource and not (isinstance(aud, list) and resource in aud):
        raise IdpError(f"access token aud {aud!r} != resource {resource!r}")
    return access_token
