"""Every statement on `account_choices`: the account a user chose for an MCP client."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Delete, Insert, Select, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from app.auth.principal import Principal
from app.models import AccountChoice


def chosen(principal: Principal, client_id: str, provider: str) -> Select[str]:
    """The upstream account id the principal chose for `client_id` at `provider`."""
    return select(AccountChoice.account_id).where(
        AccountChoice.issuer == principal.issuer,
        AccountChoice.subject == principal.subject,
        AccountChoice.client_id == client_id,
        AccountChoice.provider == provider,
    )


def remember(
    dialect: str,
    principal: Principal,
    client_id: str,
    provider: str,
    account_id: str,
    now: datetime,
) -> Insert:
    """Record (or replace) the principal's choice for `client_id` at `provider`."""
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    values = {
        "issuer": principal.issuer,
        "subject": principal.subject,
        "client_id": client_id,
        "provider": provider,
        "account_id": account_id,
        "chosen_at": now,
    }
    return (
        insert(AccountChoice)
        .values(**values)
        .on_conflict_do_update(
            index_elements=["issuer", "subject", "client_id", "provider"],
            set_={"account_id": account_id, "chosen_at": now},
        )
    )


def forget(principal: Principal, provider: str, account_id: str) -> Delete:
    """Every client's choice of an account (it was disconnected)."""
    return delete(AccountChoice).where(
        AccountChoice.issuer == principal.issuer,
        AccountChoice.subject == principal.subject,
        AccountChoice.provider == provider,
        AccountChoice.account_id == account_id,
    )


def of_user(issuer: str, subject: str) -> Delete:
    """Every choice of the user (an erasure)."""
    return delete(AccountChoice).where(
        AccountChoice.issuer == issuer, AccountChoice.subject == subject
    )


def count_of_user(issuer: str, subject: str) -> Select[int]:
    """How many choices the user has (what an erasure reports)."""
    return select(func.count()).where(
        AccountChoice.issuer == issuer, AccountChoice.subject == subject
    )
