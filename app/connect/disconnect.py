"""Disconnecting: delete the credential, then revoke upstream where the provider supports it.

The deletion is committed before the provider is asked: whatever the provider answers, and however
long it takes, no usable credential stays behind, and no pooled connection or row lock is held
while it answers (SECURITY.md T21). The caller reports an upstream failure to the user.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from app import credentials
from app.auth.principal import Principal
from app.providers import oauth
from app.providers.settings import OAuthProviderSettings
from app.runtime import Runtime

logger = logging.getLogger("broker.providers")


@dataclass(frozen=True)
class Disconnected:
    existed: bool
    revoked_upstream: bool  # False when the provider has no revocation or it failed
    upstream_failed: bool


async def disconnect(
    session: AsyncSession,
    runtime: Runtime,
    *,
    principal: Principal,
    provider: str,
    audience: str,
) -> Disconnected:
    """Delete the connection and commit `session`, then revoke the grant upstream."""
    row = await credentials.find(
        session, principal=principal, provider=provider, audience=audience, for_update=True
    )
    if row is None:
        return Disconnected(existed=False, revoked_upstream=False, upstream_failed=False)
    secret = credentials.open_row(row, keys=runtime.sealing_keys)
    await credentials.remove(session, principal=principal, provider=provider, audience=audience)
    await session.commit()
    settings = runtime.settings.providers.get(provider)
    revoked = failed = False
    if isinstance(settings, OAuthProviderSettings) and settings.revokes and secret:
        try:
            await oauth.revoke(settings, runtime.http, secret)
            revoked = True
        except oauth.UpstreamError as exc:
            failed = True
            logger.warning("oauth.revocation_failed provider=%s reason=%s", provider, exc.reason)
    return Disconnected(existed=True, revoked_upstream=revoked, upstream_failed=failed)
