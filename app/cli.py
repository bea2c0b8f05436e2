"""The `connect-broker` command."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from typing import Any

from app import devmode
from app.config import (
    ConfigError,
    Settings,
    config_path,
    load_settings,
    require_serve_ready,
)
from app.crypto import generate_key
from app.logsetup import configure_logging

# How long an idle HTTP connection stays open. uvicorn's default (5 s) equals httpx's default
# keep-alive expiry, the client of the official MCP Python SDK: a call made about 5 s after the
# previous one could go out on a connection the broker was closing, and fail with a read error.
# Longer than common load balancers' idle timeouts (60 s) for the same reason.
KEEP_ALIVE_SECONDS = 65


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.handler(args)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="connect-broker", description=__doc__)
    parser.add_argument("--config", help="TOML file (default: $BROKER_CONFIG or ./broker.toml)")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the broker")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.set_defaults(handler=_serve)

    dev = commands.add_parser("dev", help="loopback playground with a development IdP")
    dev.add_argument("--port", type=int, default=8000)
    dev.set_defaults(handler=_dev)

    token = commands.add_parser("dev-token", help="print a bearer token for the dev playground")
    token.add_argument("user")
    token.set_defaults(handler=_dev_token)

    migrate = commands.add_parser("migrate", help="create or upgrade the database schema")
    migrate.set_defaults(handler=_migrate)

    check = commands.add_parser("check-config", help="validate the configuration")
    check.set_defaults(handler=_check_config)

    keys = commands.add_parser("keys", help="key management")
    key_commands = keys.add_subparsers(required=True, metavar="ACTION")
    generate = key_commands.add_parser("generate", help="print a fresh [keys] block")
    generate.set_defaults(handler=_keys_generate)
    rotate = key_commands.add_parser(
        "rotate", help="re-seal stored credentials with the first (active) encryption key"
    )
    rotate.set_defaults(handler=_keys_rotate)

    service = commands.add_parser("service", help="sibling MCP servers of the integration API")
    service_commands = service.add_subparsers(required=True, metavar="ACTION")
    create = service_commands.add_parser("create", help="register a service; prints its secret")
    create.add_argument("name")
    create.add_argument("--providers", default="", help="comma-separated; default: all")
    create.set_defaults(handler=_service_create)
    listing = service_commands.add_parser("list", help="list registered services")
    listing.set_defaults(handler=_service_list)
    revoke = service_commands.add_parser("revoke", help="revoke a service's secret")
    revoke.add_argument("name")
    revoke.set_defaults(handler=_service_revoke)

    pending = commands.add_parser(
        "revocations", help="grants disconnected but not yet revoked at their provider"
    )
    pending_commands = pending.add_subparsers(required=True, metavar="ACTION")
    pending_list = pending_commands.add_parser(
        "list",
        help="one line each, the next due first: id, provider, issuer, subject, attempts, "
        "last error, next attempt, disconnected at",
    )
    pending_list.set_defaults(handler=_revocations_list)
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(config_path(args.config))
    require_serve_ready(settings)
    return settings


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.db import is_sqlite
    from app.migrate import is_current

    settings = _settings(args)
    if not is_current(settings.database.url):
        raise ConfigError("database.url: the schema is not current; run `connect-broker migrate`")
    configure_logging()
    if args.workers > 1 and is_sqlite(settings.database.url):
        logging.getLogger("broker").warning(
            "serve.sqlite_workers workers=%d: SQLite is for one process. Each worker queues for "
            "SQLite's write lock and bounds its log file on its own, so under load writers of "
            "different workers can starve one another; use --workers 1, or PostgreSQL",
            args.workers,
        )
    if args.config:
        os.environ["BROKER_CONFIG"] = args.config
    uvicorn.run(
        "app.asgi:create_served_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        access_log=False,
        server_header=False,
        log_config=None,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from app.migrate import upgrade

    settings = load_settings(config_path(args.config))
    upgrade(settings.database.url)
    print("database schema is current")
    return 0


def _check_config(args: argparse.Namespace) -> int:
    settings = _settings(args)
    print(
        f"configuration OK ({settings.source}): public_url {settings.public_url}, "
        f"issuer {settings.identity.issuer}, {len(settings.providers)} provider(s)"
    )
    return 0


def _keys_generate(_args: argparse.Namespace) -> int:
    suffix = secrets.token_hex(3)
    print("[keys]")
    print(f'signing = ["{generate_key("s-" + suffix)}"]')
    print(f'encryption = ["{generate_key("e-" + suffix)}"]')
    return 0


def _keys_rotate(args: argparse.Namespace) -> int:
    from app.credentials import reseal_all
    from app.crypto import Keyring

    settings = _settings(args)
    keys = Keyring.parse(tuple(k.get_secret_value() for k in settings.keys.encryption))
    count = _with_session(settings, lambda session: reseal_all(session, keys=keys))
    print(f"re-sealed {count} credential(s) with key {keys.current()[0]}")
    return 0


def _with_session(settings: Settings, work: Any) -> Any:
    """Run `work(session)` in one committed transaction against the configured database."""
    import asyncio

    from app.db import create_engine, create_sessionmaker
    from app.migrate import is_current

    if not is_current(settings.database.url):
        raise ConfigError("database.url: the schema is not current; run `connect-broker migrate`")

    async def run() -> Any:
        engine = create_engine(settings.database.url, pool_size=1)
        try:
            async with create_sessionmaker(engine).begin() as session:
                return await work(session)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _service_usage_error(argument: str, message: str) -> int:
    """A bad argument is a usage error (exit 2, like argparse's own), not a configuration error."""
    print(f"connect-broker service create: error: argument {argument}: {message}", file=sys.stderr)
    return 2


def _service_create(args: argparse.Namespace) -> int:
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
    settings = _settings(args)
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


def _service_list(args: argparse.Namespace) -> int:
    from app.integration_api import services

    for row in _with_session(_settings(args), services.list_all):
        state = f"revoked {row.revoked_at:%Y-%m-%d}" if row.revoked_at else "active"
        print(f"{row.name}\t{row.providers or '*'}\t{state}")
    return 0


def _service_revoke(args: argparse.Namespace) -> int:
    from app.integration_api import services

    done = _with_session(_settings(args), lambda session: services.revoke(session, name=args.name))
    print(f"service {args.name!r} " + ("revoked" if done else "not found or already revoked"))
    return 0 if done else 1


def _revocations_list(args: argparse.Namespace) -> int:
    from app.connect import revocations

    for row in _with_session(_settings(args), revocations.listing):
        print(
            f"{row.id}\t{row.provider}\t{row.issuer}\t{row.subject}\t{row.attempts}\t"
            f"{row.last_error or '-'}\t{row.next_attempt_at:%Y-%m-%dT%H:%M:%SZ}\t"
            f"{row.created_at:%Y-%m-%dT%H:%M:%SZ}"
        )
    return 0


def _dev(args: argparse.Namespace) -> int:
    import uvicorn

    from app.main import create_app
    from app.migrate import upgrade

    state = devmode.dev_state(args.port)
    settings = devmode.dev_settings(state)
    upgrade(settings.database.url)
    idp = devmode.dev_idp(settings, state)
    configure_logging()
    token = idp.mint("alice")
    print(devmode.dev_banner(settings, token), flush=True)
    app = create_app(settings, dev_idp=idp)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        access_log=False,
        log_config=None,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    return 0


def _dev_token(args: argparse.Namespace) -> int:
    state = devmode.dev_state(None)
    settings = devmode.dev_settings(state)
    print(devmode.dev_idp(settings, state).mint(args.user))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
