"""The `connect-broker` command."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import sys
from pathlib import Path

from app import admin_commands as admin
from app import devmode
from app import operator_commands as operator
from app.cli_errors import CommandFailed
from app.config import ConfigError, config_path, load_serve_settings, load_settings
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
    except CommandFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file or directory the command needs: the environment, not a bug
        where = f"{exc.filename}: " if exc.filename else ""
        print(
            f"error: {where}{exc.strerror or exc}; check the path and its permissions",
            file=sys.stderr,
        )
        return 1
    return result


def _require_free_port(host: str, port: int) -> None:
    """Fail in one line, before starting, when `host:port` cannot be listened on.

    Raises:
        CommandFailed: the port is taken or not ours to use.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        raise CommandFailed(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; stop what is using it "
            "or choose another --port/--host"
        ) from None


def _port(text: str) -> int:
    """A TCP port number, for `--port` (argparse says what is wrong with anything else)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r:.40}: not a number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: ports are 1 to 65535")
    return port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="connect-broker", description=__doc__)
    parser.add_argument("--config", help="TOML file (default: $BROKER_CONFIG or ./broker.toml)")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the broker")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--workers", type=int, default=1)
    serve.set_defaults(handler=_serve)

    dev = commands.add_parser("dev", help="loopback playground with a development IdP")
    dev.add_argument("--port", type=_port, default=8000)
    dev.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help="TOML file whose [providers.*] and [services.*] join the playground",
    )
    _data_dir_option(dev, devmode.DEFAULT_DATA_DIR)
    dev.set_defaults(handler=_dev)

    token = commands.add_parser("dev-token", help="print a bearer token for the dev playground")
    token.add_argument("user")
    _data_dir_option(token, devmode.DEFAULT_DATA_DIR)
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
    rotate.set_defaults(handler=admin.keys_rotate)

    service = commands.add_parser("service", help="sibling MCP servers of the integration API")
    service_commands = service.add_subparsers(required=True, metavar="ACTION")
    create = service_commands.add_parser("create", help="register a service; prints its secret")
    create.add_argument("name")
    create.add_argument("--providers", default="", help="comma-separated; default: all")
    _data_dir_option(create, None)
    create.set_defaults(handler=admin.service_create)
    listing = service_commands.add_parser("list", help="list registered services")
    _data_dir_option(listing, None)
    listing.set_defaults(handler=admin.service_list)
    revoke = service_commands.add_parser("revoke", help="revoke a service's secret")
    revoke.add_argument("name")
    _data_dir_option(revoke, None)
    revoke.set_defaults(handler=admin.service_revoke)

    pending = commands.add_parser(
        "revocations",
        help="grants disconnected, and tokens discarded, but not yet revoked at their provider",
    )
    pending_commands = pending.add_subparsers(required=True, metavar="ACTION")
    pending_list = pending_commands.add_parser(
        "list",
        help="one line each, the next due first: id, provider, issuer, subject, attempts, "
        "last error, next attempt, queued at",
    )
    pending_list.set_defaults(handler=admin.revocations_list)

    audit = commands.add_parser("audit", help="lifecycle events (no secrets)")
    audit_commands = audit.add_subparsers(required=True, metavar="ACTION")
    audit_list = audit_commands.add_parser(
        "list",
        help="one line each, oldest first: time, event, actor kind, actor, issuer, subject, "
        "provider, audience, account, detail, request id ('-' when empty)",
    )
    audit_list.add_argument("--issuer", help="only this user's events (with --subject)")
    audit_list.add_argument("--subject")
    audit_list.add_argument("--provider")
    audit_list.add_argument("--since", help="ISO-8601 time (UTC if no offset) or 30m, 12h, 7d")
    audit_list.set_defaults(handler=admin.audit_list)
    _operator_commands(commands)
    return parser


def _operator_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`users erase`, `connections list|revoke`."""
    users = commands.add_parser("users", help="what the broker holds about a user")
    user_commands = users.add_subparsers(required=True, metavar="ACTION")
    erase = user_commands.add_parser(
        "erase",
        help="revoke every grant (queued), delete the user's connections, flows, browser "
        "sessions and audit events older than [audit] erase_hold_days; prints the counts",
    )
    _user_options(erase, required=True)
    erase.set_defaults(handler=operator.users_erase)

    connections = commands.add_parser("connections", help="stored connections (never secrets)")
    connection_commands = connections.add_subparsers(required=True, metavar="ACTION")
    listing = connection_commands.add_parser(
        "list",
        help="one line each: id, issuer, subject, provider, service ('mcp': the broker's own "
        "tools), status, account, scopes, created, updated, last used (day)",
    )
    _user_options(listing, required=False)
    listing.add_argument("--provider")
    listing.add_argument("--service", help="the audience: a service's name, or mcp")
    listing.set_defaults(handler=operator.connections_list)
    revoke = connection_commands.add_parser(
        "revoke", help="delete a connection; its grant's revocation is queued"
    )
    _user_options(revoke, required=True)
    revoke.add_argument("--provider", required=True)
    revoke.add_argument(
        "--service", help="the service that made it (default: the broker's own tools, mcp)"
    )
    revoke.set_defaults(handler=operator.connections_revoke)


def _user_options(command: argparse.ArgumentParser, *, required: bool) -> None:
    command.add_argument("--issuer", required=required, help="the user's issuer (iss)")
    command.add_argument("--subject", required=required, help="the user's subject")


def _data_dir_option(command: argparse.ArgumentParser, default: Path | None) -> None:
    """`--data-dir`: the `dev` playground's directory; a service command given it works on the
    playground instead of the configured broker."""
    command.add_argument(
        "--data-dir",
        type=Path,
        default=default,
        help="the dev playground's data directory"
        + (f" (default: ./{default})" if default else "; `connect-broker dev` prints it"),
    )


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.db import is_sqlite
    from app.migrate import require_current
    from app.serving import guarded_protocol

    settings = load_serve_settings(args.config)
    require_current(settings.database.connect_url())
    _require_free_port(args.host, args.port)
    configure_logging(json=settings.logging.format == "json")
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
        http=guarded_protocol(
            settings.server.header_timeout_seconds, settings.server.max_connections
        ),
    )
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from app.migrate import upgrade

    settings = load_settings(config_path(args.config))
    print(upgrade(settings.database.connect_url()))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from app.config_check import check

    report = check(config_path(args.config), os.environ)
    for problem in report.problems:
        print(f"configuration error: {problem}", file=sys.stderr)
    if report.settings is None:
        return 2
    settings = report.settings
    print(
        f"configuration OK ({settings.source}): public_url {settings.public_url}, "
        f"issuer {settings.identity.issuer} answers, database schema current, "
        f"{len(settings.providers)} provider(s), {len(settings.webhooks)} webhook(s)"
    )
    for name, webhook in settings.webhooks.items():
        print(f"webhook {name}: {', '.join(webhook.events)} to {webhook.display_url}")
    return 0


def _keys_generate(_args: argparse.Namespace) -> int:
    suffix = secrets.token_hex(3)
    print("[keys]")
    print(f'signing = ["{generate_key("s-" + suffix)}"]')
    print(f'encryption = ["{generate_key("e-" + suffix)}"]')
    return 0


def _dev(args: argparse.Namespace) -> int:
    import uvicorn

    from app.main import create_app
    from app.migrate import upgrade

    # The port first, before anything is written: on a busy port the data directory stays as it is
    listener = _loopback_listener(args.port)
    if listener is None:
        print(
            f"connect-broker dev: port {args.port} on 127.0.0.1 is in use; stop what is "
            "listening there or choose another with --port",
            file=sys.stderr,
        )
        return 1
    with listener:
        state = devmode.new_state(args.data_dir, args.port, getattr(args, "config", None))
        settings = devmode.dev_settings(args.data_dir, state)
        devmode.save_state(args.data_dir, state)
        upgrade(settings.database.url)
        idp = devmode.dev_idp(args.data_dir, settings, state)
        configure_logging(json=settings.logging.format == "json")
        token = idp.mint("alice")
        print(devmode.dev_banner(settings, token, args.data_dir), flush=True)
        app = create_app(settings, dev_idp=idp)
        config = uvicorn.Config(
            app,
            access_log=False,
            log_config=None,
            server_header=False,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
        uvicorn.Server(config).run(sockets=[listener])
    return 0


def _loopback_listener(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:`port`, or None when the port is taken."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
    except OSError:
        listener.close()
        return None
    return listener


def _dev_token(args: argparse.Namespace) -> int:
    state = devmode.saved_state(args.data_dir)
    settings = devmode.dev_settings(args.data_dir, state)
    print(devmode.dev_idp(args.data_dir, settings, state).mint(args.user))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
