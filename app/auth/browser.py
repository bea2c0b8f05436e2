"""Browser sessions at the broker: a random id in a `__Host-` cookie, a server-side row.

The cookie holds 256 random bits; the `login_sessions` row is keyed by its HMAC digest and holds
(issuer, subject, auth_time, expiry), so logout really ends the session (ASVS 7.4.1) and a new id
is minted at every login (ASVS 7.2.4). CSRF tokens are an HMAC of the session id under their own
key: valid only for that session (SECURITY.md G3). Cookies: `__Host-` prefix, Secure, HttpOnly,
SameSite=Lax (Strict would drop the cookie on a provider's redirect back), Path=/, no Domain.
Browsers treat http://127.0.0.1 and http://localhost as secure contexts, so this holds in dev too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.requests import Request
from starlette.responses import Response

from app.auth.principal import Principal
from app.clock import utcnow
from app.crypto import Digester, Keyring, constant_time_equal, hmac_digest, random_token
from app.models import LoginSession

SESSION_COOKIE = "__Host-broker_session"
LOGIN_COOKIE = "__Host-broker_login"
MAX_COOKIE_LENGTH = 4096


@dataclass(frozen=True)
class BrowserUser:
    principal: Principal
    display_name: str | None
    session_id: str  # the raw cookie value: only for deriving CSRF tokens, never logged


class BrowserSessions:
    def __init__(self, keys: Keyring, *, ttl_seconds: int, max_auth_age_seconds: int) -> None:
        self._digest = Digester(keys, "browser-session")
        self._csrf_key = keys.derive("csrf")[0]
        self._ttl = timedelta(seconds=ttl_seconds)
        self._max_auth_age = timedelta(seconds=max_auth_age_seconds)

    async def current(self, session: AsyncSession, request: Request) -> BrowserUser | None:
        """The logged-in user of this browser, if the session is live and recent enough."""
        session_id = request.cookies.get(SESSION_COOKIE)
        if not session_id or len(session_id) > MAX_COOKIE_LENGTH:
            return None
        row = await session.get(LoginSession, self._digest(session_id))
        now = utcnow()
        if row is None or row.expires_at <= now or row.auth_time <= now - self._max_auth_age:
            return None
        return BrowserUser(
            principal=Principal(row.issuer, row.subject),
            display_name=row.display_name,
            session_id=session_id,
        )

    async def start(
        self,
        session: AsyncSession,
        response: Response,
        *,
        principal: Principal,
        display_name: str | None,
        auth_time: datetime,
        previous_id: str | None = None,
    ) -> None:
        """Create a new session (always a fresh id) and set its cookie on `response`.

        The browser's previous session, if it had one, ends here (ASVS 7.2.4).
        """
        await self._delete(session, previous_id)
        session_id = random_token()
        now = utcnow()
        session.add(
            LoginSession(
                id_digest=self._digest(session_id),
                issuer=principal.issuer,
                subject=principal.subject,
                display_name=(display_name or "")[:255] or None,
                auth_time=auth_time,
                created_at=now,
                expires_at=now + self._ttl,
            )
        )
        await session.flush()
        set_cookie(response, SESSION_COOKIE, session_id, max_age=int(self._ttl.total_seconds()))

    async def end(self, session: AsyncSession, request: Request, response: Response) -> None:
        await self._delete(session, request.cookies.get(SESSION_COOKIE))
        response.delete_cookie(SESSION_COOKIE, path="/", secure=True, httponly=True, samesite="lax")

    async def _delete(self, session: AsyncSession, session_id: str | None) -> None:
        if session_id and len(session_id) <= MAX_COOKIE_LENGTH:
            await session.execute(
                delete(LoginSession).where(LoginSession.id_digest == self._digest(session_id))
            )

    def csrf_token(self, user: BrowserUser) -> str:
        return hmac_digest(self._csrf_key, user.session_id)

    def csrf_valid(self, user: BrowserUser, token: str | None) -> bool:
        """Whether `token` is this session's CSRF token. Compared as bytes: on str,
        `hmac.compare_digest` raises for non-ASCII text, and a posted "é" must be just a wrong
        token (403), not a 500."""
        return bool(token) and constant_time_equal(self.csrf_token(user), str(token))

    async def purge(self, session: AsyncSession) -> None:
        await session.execute(delete(LoginSession).where(LoginSession.expires_at <= utcnow()))


async def end_all(session: AsyncSession, principal: Principal) -> int:
    """End every browser session of the user (an erasure); how many there were."""
    result = await session.execute(
        delete(LoginSession).where(
            LoginSession.issuer == principal.issuer, LoginSession.subject == principal.subject
        )
    )
    return int(getattr(result, "rowcount", 0))


def set_cookie(response: Response, name: str, value: str, *, max_age: int) -> None:
    """`__Host-` cookies need Secure everywhere; loopback http is a secure context for browsers."""
    response.set_cookie(
        name, value, max_age=max_age, path="/", secure=True, httponly=True, samesite="lax"
    )


def same_origin_post(request: Request, public_origin: str) -> bool:
    """Reject cross-site form posts by Sec-Fetch-Site, else Origin, else Referer (SECURITY.md
    G2, T20, §5.5).

    Browsers that send Fetch Metadata say `same-origin` for our own forms, even when the page's
    referrer policy makes them send `Origin: null`; without it, Origin must be absent or ours,
    and without Origin a Referer, when sent, must be ours (our pages send only their origin).
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("origin")
    if origin is not None:
        return origin == public_origin
    referer = request.headers.get("referer")
    return referer is None or _origin_of(referer) == public_origin


def _origin_of(url: str) -> str | None:
    """`scheme://host[:port]` of an absolute URL, None for anything else."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else None
