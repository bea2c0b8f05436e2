"""The `connect-broker` commands that work on the configured database: `keys rotate`, `service …`
and `revocations list`. Each runs in one committed transaction (`_with_session`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from app.config import Settings, load_serve_settings


def keys_rotate(args: argparse.Namespace) -> int:
    from app.credentials import reseal_all
    from app.crypto import Keyring

    settings = load_serve_settings(args.config)
    keys = Keyring.parse(tuple(k.get_secret_value() for k in settings.keys.encryption))
    count = _with_session(settings, lambda session: reseal_all(session, keys=keys))
    print(f"re-sealed {count} credential(s) with key {keys.current()[0]}")
    return 0


def _service_settings(args: argparse.Namespace) -> Settings:
    """The dev playground's settings when `--data-dir` is given, else the configured broker's."""
    if args.data_dir is not None:
        from app.devmode import playground_settings

        return playground_settings(args.data_dir)
    return load_serve_settings(args.config)


def _with_session(settings: Settings, work: Any) -> Any:
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
    import re

    from app.crypto import Keyring
    from app.integration_api import services
    from app.models import BROKER_AUDIENCE

    if not re.fullmatch(r"[a-z][a-z0-9_-]{0,63}", args.name) or args.name == BROKER_AUDIENCE:
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
    keys = Keyring.parse(tuple(k.get_secret_value() for k in settings.keys.signing))
    try:
        secret = _with_session(
            settings,
            lambda session: services.create(
                session, keys=keys, name=args.name, providers=providers
            ),
        )
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


def service_list(args: argparse.Namespace) -> int:
    from app.integration_api import services

    for row in _with_session(_service_settings(args), services.list_all):
        state = f"revoked {row.revoked_at:%Y-%m-%d}" if row.revoked_at else "active"
        print(f"{row.name}\t{row.providers or '*'}\t{state}")
    return 0


def service_revoke(args: argparse.Namespace) -> int:
    from app.integration_api import services

    done = _with_session(
        _service_settings(args), lambda session: services.revoke(session, name=args.name)
    )
    print(f"service {args.name!r} " + ("revoked" if done else "not found or already revoked"))
    return 0 if done else 1


def revocations_list(args: argparse.Namespace) -> int:
    from app.connect import revocations

    for row in _with_session(load_serve_settings(args.config), revocations.listing):
        print(
            f"{row.id}\t{row.provider}\t{row.issuer}\t{row.subject}\t{row.attempts}\t"
            f"{row.last_error or '-'}\t{row.next_attempt_at:%Y-%m-%dT%H:%M:%SZ}\t"
            f"{row.created_at:%Y-%m-%dT%H:%M:%SZ}"
        )
    return 0
