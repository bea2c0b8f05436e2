"""Disconnecting: revoke upstream where the provider supports it, then delete the credential.

The credential is deleted whatever the provider answers, so a failed revocation never leaves a
usable credential behind; the caller reports the upstream failure to the user.
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
    row = await credentials.find(
        session, principal=principal, provider=provider, audience=audience, for_update=True
    )
    if row is None:
        return Disconnected(existed=False, revoked_upstream=False, upstream_failed=False)
    settings = runtime.settings.providers.get(provider)
    secret = credentials.open_row(row, keys=runtime.sealing_keys)
    revoked = failed = False
    if isinstance(settings, OAuthProviderSettings) and settings.revokes and secret:
        try:
            await oauth.revoke(settings, runtime.http, secret)
            revoked = True
        except oauth.UpstreamError as exc:
            failed = True
            logger.warning("oauth.revocation_failed provider=%s reason=%s", provider, exc.reason)
    await credentials.remove(session, principal=principal, provider=provider, audience=audience)
    return Disconnected(existed=True, revoked_upstream=revoked, upstream_failed=failed)
