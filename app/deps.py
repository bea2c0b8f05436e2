"""The named dependencies of the FastAPI routes, as `Annotated` aliases.

`app/main.py` builds each shared object once and puts it on `app.state` under the name used
here; a test overrides one of them with `app.dependency_overrides[get_x]`. The getters are
async: FastAPI would run a plain function on its thread pool, a hand-off per request.
"""

from __future__ import annotations

from typing import Annotated

import httpx2
from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.auth.browser import BrowserSessions, BrowserUser
from app.auth.jwks import JwksCache
from app.config import Settings
from app.connect.notify import FlowNotifier
from app.connect.oauth_service import OAuthGrants
from app.connect.revocations import Revoker
from app.crypto import Keys
from app.db import get_session
from app.security_log import SecurityLog


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_sessionmaker(request: Request) -> async_sessionmaker[AsyncSession]:
    maker: async_sessionmaker[AsyncSession] = request.app.state.sessionmaker
    return maker


async def get_keys(request: Request) -> Keys:
    keys: Keys = request.app.state.keys
    return keys


async def get_http(request: Request) -> httpx2.AsyncClient:
    http: httpx2.AsyncClient = request.app.state.http
    return http


async def get_security(request: Request) -> SecurityLog:
    security: SecurityLog = request.app.state.security
    return security


async def get_identity_issuer(request: Request) -> JwksCache:
    """The MCP identity provider's discovery document and keys."""
    issuer: JwksCache = request.app.state.identity_issuer
    return issuer


async def get_browser_sessions(request: Request) -> BrowserSessions:
    sessions: BrowserSessions = request.app.state.browser_sessions
    return sessions


async def get_notifier(request: Request) -> FlowNotifier:
    notifier: FlowNotifier = request.app.state.notifier
    return notifier


async def get_oauth_grants(request: Request) -> OAuthGrants:
    grants: OAuthGrants = request.app.state.oauth_grants
    return grants


async def get_revoker(request: Request) -> Revoker:
    revoker: Revoker = request.app.state.revoker
    return revoker


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]
SessionmakerDep = Annotated[async_sessionmaker[AsyncSession], Depends(get_sessionmaker)]
KeysDep = Annotated[Keys, Depends(get_keys)]
HttpDep = Annotated[httpx2.AsyncClient, Depends(get_http)]
SecurityDep = Annotated[SecurityLog, Depends(get_security)]
IdentityIssuerDep = Annotated[JwksCache, Depends(get_identity_issuer)]
BrowserSessionsDep = Annotated[BrowserSessions, Depends(get_browser_sessions)]
NotifierDep = Annotated[FlowNotifier, Depends(get_notifier)]
OAuthGrantsDep = Annotated[OAuthGrants, Depends(get_oauth_grants)]
RevokerDep = Annotated[Revoker, Depends(get_revoker)]


async def get_browser_user(
    request: Request, sessions: BrowserSessionsDep, session: SessionDep
) -> BrowserUser | None:
    """The signed-in browser user, or None."""
    return await sessions.current(session, request)


BrowserUserDep = Annotated[BrowserUser | None, Depends(get_browser_user)]
