"""`connect-broker check-config`: what `serve` will need (database, schema, IdP, secrets), every
problem at once, each naming the TOML key and the environment variable it came from."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .support.broker import BrokerConfig, cli, drop_database, fresh_database
from .support.idp import IdpProcess, free_port

pytestmark = pytest.mark.both_databases


@pytest.fixture
def database(tmp_path: Path) -> Iterator[str]:
    url = fresh_database(tmp_path, "check")
    yield url
    drop_database(url)


def config_file(tmp_path: Path, config: BrokerConfig, database_url: str, extra: str = "") -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(config.render(database_url) + extra)
    return path


def errors(stderr: str) -> list[str]:
    return [line.removeprefix("configuration error: ") for line in stderr.splitlines()]


def test_a_ready_configuration_is_ok(tmp_path: Path, idp: IdpProcess, database: str) -> None:
    path = config_file(tmp_path, BrokerConfig(issuer=idp.issuer), database)
    assert cli("migrate", config_path=path).returncode == 0

    result = cli("check-config", config_path=path)

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.startswith(f"configuration OK ({path}): public_url http://127.0.0.1:")
    assert f"issuer {idp.issuer} answers, database schema current, 0 provider(s)" in result.stdout


def test_reports_every_problem_at_once_with_key_variable_and_suggestion(
    tmp_path: Path, database: str
) -> None:
    """Unknown section and keys get the closest known name; a bad value names its key, the file
    and the variable that would set it; a value from the environment names that variable."""
    config = BrokerConfig(issuer="http://127.0.0.1:1")
    extra = '[identiy]\nissuer = "x"\n[providers.demo]\nkind = "api_key"\ndisplay_name = "D"\n'
    extra += 'patern = "^x$"\n'
    path = config_file(tmp_path, config, database, extra)
    path.write_text(path.read_text().replace("[server]\n", "[server]\nflow_ttl_seconds = 5\n"))

    result = cli(
        "check-config",
        config_path=path,
        env={"BROKER_SERVER_PUBLC_URL": "https://b.example", "BROKER_LIMITS_USER_BURST": "0"},
    )

    assert result.returncode == 2
    assert errors(result.stderr) == [
        f"identiy (in {path}): unknown section (did you mean 'identity'?)",
        f"server.flow_ttl_seconds (in {path}; or set BROKER_SERVER_FLOW_TTL_SECONDS): "
        "Input should be greater than or equal to 60",
        "server.publc_url (from BROKER_SERVER_PUBLC_URL): unknown key (did you mean 'public_url'?)",
        "limits.user_burst (from BROKER_LIMITS_USER_BURST): Input should be greater than or "
        "equal to 1",
        f"providers.demo.patern (in {path}): unknown key (did you mean 'pattern'?)",
        f"database.url (in {path}; or set BROKER_DATABASE_URL): the database has no schema yet; "
        "run `connect-broker migrate`"
        if database.startswith("postgresql")
        else f"database.url (in {path}; or set BROKER_DATABASE_URL): the database file "
        f"{database.removeprefix('sqlite:///')} does not exist yet; run `connect-broker migrate`",
        f"identity.issuer (in {path}; or set BROKER_IDENTITY_ISSUER): "
        "http://127.0.0.1:1/.well-known/openid-configuration did not answer (ConnectError); "
        "check the issuer URL and the IdP",
    ]


def test_a_missing_login_client_secret_is_caught_before_the_first_sign_in(
    tmp_path: Path, idp: IdpProcess, database: str
) -> None:
    path = config_file(tmp_path, BrokerConfig(issuer=idp.issuer, login_client_secret=""), database)
    assert cli("migrate", config_path=path).returncode == 0

    result = cli("check-config", config_path=path)

    assert result.returncode == 2
    assert errors(result.stderr) == [
        f"identity.login_client_secret (in {path}; or set BROKER_IDENTITY_LOGIN_CLIENT_SECRET): "
        "required: the secret the IdP issued for login_client_id (without it, sign-in fails at "
        "the IdP's token endpoint)"
    ]


def test_missing_serve_keys_are_all_reported(tmp_path: Path, idp: IdpProcess) -> None:
    path = tmp_path / "broker.toml"
    path.write_text('[database]\nurl = "mysql://db.example/broker"\n')

    result = cli("check-config", config_path=path)

    assert result.returncode == 2
    assert errors(result.stderr) == [
        f"identity.issuer (in {path}; or set BROKER_IDENTITY_ISSUER): required (the IdP whose "
        "tokens /mcp accepts)",
        f"identity.login_client_id (in {path}; or set BROKER_IDENTITY_LOGIN_CLIENT_ID): required "
        "(the broker's own login client)",
        f"keys.signing (in {path}; or set BROKER_KEYS_SIGNING): at least one key is required",
        f"keys.encryption (in {path}; or set BROKER_KEYS_ENCRYPTION): at least one key is required",
        f"database.url (in {path}; or set BROKER_DATABASE_URL): unsupported database 'mysql' "
        "(use sqlite:///path or postgresql://user@host/db)",
    ]


def test_an_unreachable_database_and_a_wrong_issuer(
    tmp_path: Path, idp: IdpProcess, database: str
) -> None:
    """The IdP answers but names itself differently (a trailing slash is the usual mistake)."""
    port = free_port()
    path = config_file(tmp_path, BrokerConfig(issuer=idp.issuer + "/"), database)
    url = f"postgresql://broker:pw@127.0.0.1:{port}/broker"

    result = cli("check-config", config_path=path, env={"BROKER_DATABASE_URL": url})

    assert result.returncode == 2
    assert errors(result.stderr) == [
        "database.url (from BROKER_DATABASE_URL): cannot use the database at "
        f"postgresql://broker:***@127.0.0.1:{port}/broker: Connect call failed "
        f"('127.0.0.1', {port}); check that the database is running and reachable",
        f"identity.issuer (in {path}; or set BROKER_IDENTITY_ISSUER): the IdP names itself "
        f"'{idp.issuer}' in {idp.issuer}/.well-known/openid-configuration; set identity.issuer "
        "to exactly that",
    ]


def test_a_provider_authenticating_with_http_basic_needs_its_secret(
    tmp_path: Path, idp: IdpProcess, database: str
) -> None:
    """Notion's preset authenticates the client with HTTP Basic: an empty secret cannot work."""
    config = BrokerConfig(
        issuer=idp.issuer, providers={"notion": {"preset": "notion", "client_id": "n-client"}}
    )
    path = config_file(tmp_path, config, database)
    assert cli("migrate", config_path=path).returncode == 0

    result = cli("check-config", config_path=path)

    assert result.returncode == 2
    assert errors(result.stderr) == [
        f"providers.notion.client_secret (in {path}; or set "
        "BROKER_PROVIDERS_NOTION_CLIENT_SECRET): required: its token endpoint authenticates the "
        "client with HTTP Basic "
        "(client_auth_method client_secret_basic)"
    ]
