"""The `connect-broker` commands on users and connections: `users erase`, `connections list`,
`connections revoke`. Each runs in one committed transaction; none prints a secret."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.admin_commands import table_cell, usage_error, with_session
from app.config import Settings, load_serve_settings

CLI_ACTOR_ID = "cli"


def _sealing(settings: Settings) -> Any:
    from app.crypto import Keyring

    return Keyring.parse(tuple(k.get_secret_value() for k in settings.keys.encryption))


def users_erase(args: argparse.Namespace) -> int:
    from app import audit, cli_filters
    from app.auth.principal import Principal
    from app.connect.erasure import erase_user

    try:
        user = cli_filters.user(args.issuer, args.subject)
    except cli_filters.BadArgument as exc:
        return usage_error("users erase", exc)
    assert user is not None  # both options are required
    settings = load_serve_settings(args.config)
    sealing = _sealing(settings)
    erased = with_session(
        settings,
        lambda session: erase_user(
            session,
            principal=Principal(*user),
            sealing=sealing,
            providers=settings.providers,
            hold_days=settings.audit.erase_hold_days,
            actor=audit.CLI,
        ),
    )
    print(f"erased {user[1]!r} of {user[0]!r}: {erased.summary()}")
    return 0


def connections_list(args: argparse.Namespace) -> int:
    from app import cli_filters
    from app.tables import connections as connections_table

    try:
        user = cli_filters.user(args.issuer, args.subject)
        provider = cli_filters.text("--provider", args.provider)
        service = cli_filters.text("--service", args.service)
    except cli_filters.BadArgument as exc:
        return usage_error("connections list", exc)
    statement = connections_table.listing(
        issuer=user[0] if user else None,
        subject=user[1] if user else None,
        provider=provider,
        audience=service,
    )

    async def rows(session: Any) -> list[Any]:
        return list((await session.execute(statement)).scalars())

    for row in with_session(load_serve_settings(args.config), rows):
        used = f"{row.last_used_at:%Y-%m-%d}" if row.last_used_at else "-"
        cells = (row.issuer, row.subject, row.provider, row.audience, row.status)
        print(
            f"{row.id}\t" + "\t".join(table_cell(value) for value in cells) + "\t"
            f"{table_cell(row.account_label)}\t{table_cell(row.scopes)}\t"
            f"{row.created_at:%Y-%m-%dT%H:%M:%SZ}\t{row.updated_at:%Y-%m-%dT%H:%M:%SZ}\t{used}"
        )
    return 0


def connections_revoke(args: argparse.Namespace) -> int:
    from app import audit, cli_filters
    from app.auth.principal import Principal
    from app.connect.removal import remove_connection
    from app.models import BROKER_AUDIENCE
    from app.tables import connections as connections_table

    try:
        user = cli_filters.user(args.issuer, args.subject)
        provider = cli_filters.text("--provider", args.provider) or ""
        audience = cli_filters.text("--service", args.service) or BROKER_AUDIENCE
    except cli_filters.BadArgument as exc:
        return usage_error("connections revoke", exc)
    assert user is not None  # both options are required
    settings = load_serve_settings(args.config)
    sealing = _sealing(settings)
    principal = Principal(*user)

    async def revoke(session: Any) -> bool | None:
        """Every account of the user at the provider (each its own connection)."""
        statement = connections_table.accounts(principal, provider, audience).with_for_update()
        rows = list((await session.execute(statement)).scalars())
        if not rows:
            return None
        queued = [
            await remove_connection(
                session,
                row,
                sealing=sealing,
                providers=settings.providers,
                actor=audit.CLI,
                event="connection.revoked",
            )
            for row in rows
        ]
        return any(queued)

    queued = with_session(settings, revoke)
    if queued is None:
        print(f"no {provider!r} connection of that user through {audience!r}", file=sys.stderr)
        return 1
    upstream = "its revocation is queued" if queued else "the provider has no revocation"
    print(f"revoked the {provider!r} connection through {audience!r}; {upstream}")
    return 0
