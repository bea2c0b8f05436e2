"""Who may use a connect page: a signed-in user whose identity is the flow's (MCP elicitation
§Phishing), and for a POST a same-origin request that carries the session's CSRF token."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.exceptions import HTTPException

from app.auth.browser import BrowserSessions, BrowserUser, same_origin_post
from app.connect import service as flows
from app.connect.service import FlowView
from app.deps import BrowserSessionsDep, BrowserUserDep, SettingsDep
from app.errors import CsrfFailed, Forbidden, NotFound, PayloadTooLarge
from app.security_log import SecurityLog

FLOW_ID = re.compile(r"[A-Za-z0-9_-]{43}")  # fullmatch: `$` allows a trailing newline
MAX_FORM_BYTES = 16 * 1024


class WrongAccount(Forbidden):
    code = "wrong_user"
    title = "This link belongs to a different account"
    message = (
        "This connect link was started by a different account than the one you are signed in "
        "with. Nothing was changed."
    )
    next_step = "Sign out and sign in with the account you use in your MCP client."


class SignInRequired(Forbidden):
    code = "sign_in_required"
    title = "Please sign in"
    message = "You need to be signed in to do this."
    next_step = "Open the link from your MCP client again."


async def flow_for_user(
    session: AsyncSession,
    flow_id: str,
    user: BrowserUser,
    *,
    sessions: BrowserSessions,
    security: SecurityLog,
) -> FlowView:
    """The flow `flow_id` when it is `user`'s own; a refusal page (and an event) otherwise."""
    if not FLOW_ID.fullmatch(flow_id):
        raise NotFound()
    flow = await flows.get(session, flow_id=flow_id)
    if flow is None:
        raise NotFound()
    if flow.principal != user.principal:
        security.event("connect.identity_mismatch", flow_id=flow.id)
        raise WrongAccount(page={"show_logout": True, "csrf_token": sessions.csrf_token(user)})
    return flow


@dataclass(frozen=True, slots=True)
class SignedInForm:
    user: BrowserUser
    values: dict[str, str]


async def signed_in_post(
    request: Request,
    settings: SettingsDep,
    sessions: BrowserSessionsDep,
    user: BrowserUserDep,
) -> SignedInForm:
    """The signed-in user and the form of a same-origin POST carrying their CSRF token.

    Raises:
        SignInRequired: no live browser session.
        CsrfFailed: cross-site, or a missing or foreign CSRF token.
    """
    if user is None:
        raise SignInRequired()
    if not same_origin_post(request, settings.public_origin):
        raise CsrfFailed()
    declared = request.headers.get("content-length", "0")
    if not declared.isdigit() or int(declared) > MAX_FORM_BYTES:
        raise PayloadTooLarge()
    try:  # a chunked body has no Content-Length: Starlette's own limits stop it (as a 400)
        form = await request.form(max_files=0, max_fields=8, max_part_size=MAX_FORM_BYTES)
    except HTTPException:
        raise PayloadTooLarge() from None
    values = {key: str(value) for key, value in form.items()}
    if not sessions.csrf_valid(user, values.get("csrf")):
        raise CsrfFailed()
    return SignedInForm(user, values)


SignedInPost = Annotated[SignedInForm, Depends(signed_in_post)]
