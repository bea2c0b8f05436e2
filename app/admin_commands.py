"""The `connect-broker` commands that work on the configured database: `keys rotate`, `service …`,
`revocations list` and `audit list`. Each runs in one committed transaction (`with_session`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.config import Settings, load_serve_settings


def keys_rotate(args: argparse.Namespace) -> int:
    from app import audit
    from app.credentials import Resealed, reseal_all
    from app.crypto import Keyring

    settings = load_serve_settings(args.config)
    keys = Keyring.parse(tuple(k.get_secret_value() for k in settings.keys.encryption))
    key_id = keys.current()[0]

    async def rotate(session: Any) -> Resealed:
        done = await reseal_all(session, keys=keys)
        detail = f"key={key_id} resealed={done.resealed} unopened={done.unopened}"
        await audit.record(session, "keys.rotated", actor=audit.CLI, detail=detail)
        return done

    done: Resealed = with_session(settings, rotate)
    print(f"re-sealed {done.resealed} credential(s) with key {key_id}")
    if done.unopened:
        print(
            f"error: {done.unopened} credential(s) could not be opened with any configured key "
            "(the log names them); keep the old keys until they are re-sealed or removed",
            file=sys.stderr,
        )
        return 1
    return 0


def _service_settings(args: argparse.Namespace) -> Settings:
    """The dev playground's settings when `--data-dir` is given, else the configured broker's."""
    if args.data_dir is not None:
        from app.devmode import playground_settings

        return playground_settings(args.data_dir)
    return load_serve_settings(args.config)


def with_session(settings: Settings, work: Any) -> Any:
    """Run `work(session)` in one committed transaction against the configured database."""
    import asyncio

    from app.db import create_engine, create_sessionmaker
    from app.migrate import require_current, translated_errors

    require_current(settings.database.connect_url())

    async def run() -> Any:
        engine = create_engine(settings.database.connect_url(), pool_size=1)
        try:
            async with create_sessionmaker(engine).begin() as session:
                return await work(session)
        finally:
            await engine.dispose()

    with translated_errors(settings.database.url):
        return asyncio.run(run())


def _service_usage_error(argument: str, message: str) -> int:
    """A bad argument is a usage error (exit 2, like argparse's own), not a configuration error."""
    print(f"connect-broker service create: error: argument {argument}: {message}", file=sys.stderr)
    return 2


def service_create(args: argparse.Namespace) -> int:
    from app.models import BROKER_AUDIENCE, SERVICE_NAME

    if not SERVICE_NAME.fullmatch(args.name) or args.name == BROKER_AUDIENCE:
        return _service_usage_error(
            "name",
            f"{args.name!r:.80} is not a service name (1-64 lowercase letters, digits, - and _, "
            "starting with a letter; 'mcp' is reserved for the broker itself)",
        )
    settings = _service_settings(args)
    providers = tuple(p.strip() for p in args.providers.split(",") if p.strip())
    unknown = [p for p in providers if p not in settings.providers]
    if unknown:
        known = ", ".join(sorted(settings.providers)) or "none"
        return _service_usage_error(
            "--providers", f"unknown provider {unknown[0]!r:.80} (configured: {known})"
        )
    try:
        secret = create_service(settings, args.name, providers)
    except Exception as exc:  # a duplicate name violates the unique constraint
        if "unique" in str(exc).lower() or "duplicate" in str(exc).lower():
            print(f"a service named {args.name!r} already exists", file=sys.stderr)
            return 1
        raise
    print(secret)
    print(
        f"# service {args.name!r} created; the secret above is shown only once",
        file=sys.stderr,
    )
    return 0


def create_service(settings: Settings, name: str, providers: tuple[str, ...]) -> str:
    """Register service `name` (checked by the caller) and return its secret."""
    from app.crypto import Keyring
    from app.integration_api import services

    keys = Keyring.parse(tuple(k.get_secret_value() for k in settings.keys.signing))
    return str(
        with_session(
            settings,
            lambda session: services.create(session, keys=keys, name=name, providers=providers),
        )
    )


def service_list(args: argparse.Namespace) -> int:
    from app.integration_api import services

    for row in with_session(_service_settings(args), services.list_all):
        state = f"revoked {row.revoked_at:%Y-%m-%d}" if row.revoked_at else "active"
        print(f"{row.name}\t{row.providers or '*'}\t{state}")
    return 0


def service_revoke(args: argparse.Namespace) -> int:
    from app import cli_filters
    from app.integration_api import services

    try:
        cli_filters.text("name", args.name)
    except cli_filters.BadArgument as exc:
        return usage_error("service revoke", exc)
    done = with_session(
        _service_settings(args), lambda session: services.revoke(session, name=args.name)
    )
    print(f"service {args.name!r} " + ("revoked" if done else "not found or already revoked"))
    return 0 if done else 1


def revocations_list(args: argparse.Namespace) -> int:
    from app.connect import revocations

    for row in with_session(load_serve_settings(args.config), revocations.listing):
        print(
            f"{row.id}\t{row.provider}\t{row.issuer}\t{row.subject}\t{row.attempts}\t"
            f"{row.last_error or '-'}\t{row.next_attempt_at:%Y-%m-%dT%H:%M:%SZ}\t"
            f"{row.created_at:%Y-%m-%dT%H:%M:%SZ}"
        )
    return 0


AUDIT_LIMIT = 10_000  # the most recent rows `audit list` prints; narrow with --since or a filter


def usage_error(command: str, exc: Exception) -> int:
    """A refused argument: one line naming it, exit 2 (like argparse's own usage errors)."""
    argument = getattr(exc, "argument", "")
    print(f"connect-broker {command}: error: argument {argument}: {exc}", file=sys.stderr)
    return 2


def audit_list(args: argparse.Namespace) -> int:
    from app import cli_filters
    from app.tables import audit as audit_table

    try:
        user = cli_filters.user(args.issuer, args.subject)
        provider = cli_filters.text("--provider", args.provider)
        since = cli_filters.since(args.since)
    except cli_filters.BadArgument as exc:
        return usage_error("audit list", exc)
    statement = audit_table.listing(
        issuer=user[0] if user else None,
        subject=user[1] if user else None,
        provider=provider,
        since=since,
        limit=AUDIT_LIMIT,
    )

    async def rows(session: Any) -> list[Any]:
        return list((await session.execute(statement)).scalars())[::-1]  # oldest first

    for row in with_session(load_serve_settings(args.config), rows):
        fields = (
            row.actor_kind,
            row.actor_id,
            row.issuer,
            row.subject,
            row.provider,
            row.audience,
            row.account_label,
            row.detail,
            row.request_id,
        )
        shown = "\t".join(table_cell(value) for value in fields)
        print(f"{row.occurred_at:%Y-%m-%dT%H:%M:%SZ}\t{row.event}\t{shown}")
    return 0


def table_cell(value: str | None) -> str:
    """A column as one tab-separated cell: '-' when empty; tabs and line breaks escaped."""
    if not value:
        return "-"
    return value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
