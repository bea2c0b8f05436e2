"""Configuration: TOML + BROKER_* overrides, validation that names the bad key, CLI checks."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import pytest
from joserfc.jws import JWSRegistry

from app.config import (
    SIGNATURE_ALGORITHMS,
    ConfigError,
    Settings,
    load_settings,
    require_serve_ready,
)
from app.crypto import generate_key
from app.providers.settings import ApiKeyProviderSettings, OAuthProviderSettings

from .support.broker import BrokerConfig, cli
from .support.http import local_get
from .support.idp import free_port

KEYS = f'signing = ["{generate_key("s1")}"]\nencryption = ["{generate_key("e1")}"]\n'
VALID = f"""
[server]
public_url = "https://broker.example.com"

[identity]
issuer = "https://idp.example.com"
login_client_id = "broker"

[keys]
{KEYS}
[providers.demo]
kind = "api_key"
display_name = "Demo"
pattern = "^sk_[a-z0-9]+$"
"""


BOT = "[services.bot]\n"
PROOF = 'user_proof = "token"\n'
BOT_AUDIENCE = 'token_audience = "https://bot.example.com/mcp"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return path


def test_defaults_and_derived_values(tmp_path: Path) -> None:
    """Documented defaults: SQLite under ./data, 20 s retry wait, 600 s flows, audience /mcp."""
    settings = load_settings(write(tmp_path, VALID), environ={})

    assert settings.database.url == "sqlite:///./data/broker.db"
    assert settings.server.retry_wait_seconds == 20
    assert settings.server.flow_ttl_seconds == 600
    assert settings.audience == "https://broker.example.com/mcp"
    assert settings.identity.identity_claim == "sub"
    assert settings.identity.required_scopes == ()
    assert settings.identity.advertised_scopes == ("openid",)
    assert settings.providers["demo"].display_name == "Demo"
    require_serve_ready(settings)


def test_environment_overrides_every_section_and_providers(tmp_path: Path) -> None:
    environ = {
        "BROKER_IDENTITY_ISSUER": "https://other-idp.example.com",
        "BROKER_SERVER_RETRY_WAIT_SECONDS": "5",
        "BROKER_IDENTITY_REQUIRED_SCOPES": "mcp:tools, openid",
        "BROKER_PROVIDERS_DEMO_DISPLAY_NAME": "Demo from env",
        "BROKER_DATABASE_URL": "postgresql://user@db.internal/broker",
        "BROKER_LIMITS_USER_REQUESTS_PER_MINUTE": "0",
    }

    settings = load_settings(write(tmp_path, VALID), environ=environ)

    assert settings.identity.issuer == "https://other-idp.example.com"
    assert settings.server.retry_wait_seconds == 5
    assert settings.identity.required_scopes == ("mcp:tools", "openid")
    assert settings.providers["demo"].display_name == "Demo from env"
    assert settings.database.url == "postgresql://user@db.internal/broker"
    assert settings.limits.user_requests_per_minute == 0


def test_secret_can_come_from_a_file(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret-from-file\n")
    text = VALID.replace(
        'login_client_id = "broker"',
        f'login_client_id = "broker"\nlogin_client_secret_file = "{secret_file}"',
    )

    settings = load_settings(write(tmp_path, text), environ={})

    assert settings.identity.login_client_secret.get_secret_value() == "s3cret-from-file"
    assert "s3cret" not in repr(settings)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (
            ('public_url = "https://broker.example.com"', 'public_url = "ftp://x"'),
            "server.public_url",
        ),
        (
            (
                'public_url = "https://broker.example.com"',
                'public_url = "http://broker.example.com"',
            ),
            "server.public_url",
        ),
        (("[server]", "[server]\nretry_wait_seconds = -1"), "server.retry_wait_seconds"),
        (("[server]", "[server]\nunknown_key = 1"), "server.unknown_key"),
        (("[server]", '[server]\nmetrics_token = "tok3n-too-brief"'), "server.metrics_token"),
        (('signing = ["', 'signing = ["x:tooshort", "'), "keys.signing"),
        (('pattern = "^sk_[a-z0-9]+$"', 'pattern = "(unclosed"'), "providers.demo.pattern"),
        (('kind = "api_key"', 'kind = "telepathy"'), "providers.demo.kind"),
        (("[identity]", '[identity]\nissuer_typo = "x"'), "identity.issuer_typo"),
        (("[server]", "[limits]\nuser_burst = 0\n[server]"), "limits.user_burst"),
        (
            ("[server]", "[limits]\nfailed_auths_per_minute = -1\n[server]"),
            "limits.failed_auths_per_minute",
        ),
        (("[server]", f'{BOT}user_proof = "tokens"\n[server]'), "services.bot.user_proof"),
        (("[server]", f'{BOT}user_proof = "token"\n[server]'), "services.bot.token_audience"),
        (
            ("[server]", f'{BOT}token_audience = "https://bot.example.com/mcp"\n[server]'),
            "services.bot.token_audience",
        ),
        (
            ("[server]", f'{BOT}{PROOF}token_audience = "bot"\n[server]'),
            "services.bot.token_audience",
        ),
        (
            (
                "[server]",
                f'{BOT}{PROOF}token_audience = "https://broker.example.com/mcp"\n[server]',
            ),
            "services.bot.token_audience",
        ),
        (
            (
                "[server]",
                f"{BOT}{PROOF}{BOT_AUDIENCE}[services.other]\n{PROOF}{BOT_AUDIENCE}[server]",
            ),
            "services.other.token_audience",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_the_key(
    tmp_path: Path, change: tuple[str, str], key: str
) -> None:
    def load_for_serve() -> None:
        require_serve_ready(load_settings(write(tmp_path, VALID.replace(*change)), environ={}))

    with pytest.raises(ConfigError) as error:
        load_for_serve()

    assert str(error.value).startswith(key)
    assert "tok3n-too-brief" not in str(error.value)  # a refused secret is not echoed


def test_user_proof_is_off_by_default_and_token_takes_the_siblings_audience(
    tmp_path: Path,
) -> None:
    text = VALID + f'{BOT}{PROOF}{BOT_AUDIENCE}[services.plain]\ndisplay_name = "Plain"\n'

    settings = load_settings(write(tmp_path, text), environ={})

    assert settings.services["plain"].user_proof == "off"
    assert settings.services["plain"].token_audience is None
    assert settings.services["bot"].user_proof == "token"
    assert settings.services["bot"].token_audience == "https://bot.example.com/mcp"
    with pytest.raises(ConfigError, match=r"^services\.bot\.token_audience: only used with"):
        load_settings(write(tmp_path, text), environ={"BROKER_SERVICES_BOT_USER_PROOF": "off"})


def test_serve_requires_an_issuer_and_keys(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "[server]\n"), environ={})

    with pytest.raises(ConfigError, match=r"^identity\.issuer"):
        require_serve_ready(settings)


def test_check_config_command_names_the_bad_key(tmp_path: Path) -> None:
    """(A configuration that passes is in tests/test_check_config.py: it needs a live IdP.)"""
    bad = cli(
        "check-config",
        config_path=write(
            tmp_path,
            VALID.replace(
                'issuer = "https://idp.example.com"', 'issuer = "https://user:pw@idp.example.com"'
            ),
        ),
    )

    assert bad.returncode == 2
    assert "identity.issuer" in bad.stderr


def test_serve_refuses_a_bad_config_the_same_way(tmp_path: Path) -> None:
    config = write(tmp_path, VALID.replace("[server]", "[server]\nflow_ttl_seconds = 5"))

    result = cli("serve", "--port", "9", config_path=config, timeout=30)

    assert result.returncode == 2
    assert "server.flow_ttl_seconds" in result.stderr


def test_keys_generate_prints_a_usable_keys_block(tmp_path: Path) -> None:
    result = cli("keys", "generate", config_path=tmp_path / "none.toml")
    text = VALID.replace(KEYS, result.stdout.split("[keys]\n", 1)[1])

    settings = load_settings(write(tmp_path, text), environ={})

    assert result.returncode == 0
    assert result.stdout.startswith("[keys]\n")
    assert len(settings.keys.signing) == 1 and len(settings.keys.encryption) == 1


def test_broker_config_renders_what_the_loader_accepts(tmp_path: Path) -> None:
    """The test harness's own config writer must stay in step with the loader."""
    config = BrokerConfig(
        issuer="http://127.0.0.1:1",
        providers={
            "demo": {
                "kind": "api_key",
                "display_name": "Demo",
                "validation": {"url": "http://127.0.0.1:2/check"},
            }
        },
    )

    settings = load_settings(write(tmp_path, config.render("sqlite:///x.db")), environ={})

    provider = settings.providers["demo"]
    assert isinstance(provider, ApiKeyProviderSettings)
    assert provider.validation is not None


@pytest.mark.parametrize("workers", [1, 2])
def test_several_workers_on_sqlite_serve_with_a_warning_and_each_logs(
    workers: int, tmp_path: Path
) -> None:
    """The write-lock queue and the WAL bound are per process (README, SQLite): more than one
    worker on SQLite still serves, with a warning that says why it is not advised."""
    config = BrokerConfig(issuer="http://127.0.0.1:1", port=free_port())
    path = write(tmp_path, config.render(f"sqlite:///{tmp_path / 'broker.db'}"))
    assert cli("migrate", config_path=path).returncode == 0
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "app.cli", "--config", str(path), "serve"]
    with log.open("wb") as output:
        process = subprocess.Popen(
            [*command, "--port", str(config.port), "--workers", str(workers)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        assert serves(f"{config.public_url}/healthz", process), log.read_text()
        answered = local_get(f"{config.public_url}/no-such-page", timeout=5)
    finally:
        process.terminate()
        process.wait(SERVE_TIMEOUT)

    text = log.read_text()
    warned = f"serve.sqlite_workers workers={workers}: SQLite is for one process" in text
    assert warned is (workers > 1), text
    # whichever worker answered wrote its access line: each worker sets up logging itself
    assert answered.status_code == 404
    assert "INFO broker.access GET /no-such-page 404" in text, text


SERVE_TIMEOUT = 30.0


def serves(url: str, process: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + SERVE_TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        with contextlib.suppress(httpx2.HTTPError):
            if local_get(url, timeout=1).status_code == 200:
                return True
        time.sleep(0.1)
    return False


def test_L14_auth_discovery_advertises_the_required_scopes_else_the_default_ones(
    tmp_path: Path,
) -> None:
    """`identity.default_scopes` (a comma list from the environment) counts only while no scope
    is required; required scopes are what a token must carry, so they are what is advertised."""
    path = write(tmp_path, VALID)

    defaults = load_settings(path, environ={"BROKER_IDENTITY_DEFAULT_SCOPES": "openid, profile"})
    required = load_settings(
        path,
        environ={
            "BROKER_IDENTITY_DEFAULT_SCOPES": "openid, profile",
            "BROKER_IDENTITY_REQUIRED_SCOPES": "mcp:tools",
        },
    )

    assert defaults.identity.advertised_scopes == ("openid", "profile")
    assert required.identity.advertised_scopes == ("mcp:tools",)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("server = 5\n", "server"),
        ('providers = "abc"\n', "providers"),
        ("[providers]\nfoo = 5\n", "providers.foo"),
        ('[services]\nfoo = "x"\n', "services.foo"),
        ('webhooks = "x"\n', "webhooks"),
    ],
    ids=["section", "named-table", "provider", "service", "webhooks"],
)
def test_a_section_or_named_table_that_is_not_a_table_is_named(
    tmp_path: Path, text: str, key: str
) -> None:
    """A value where a table belongs is one line naming it, not a traceback."""
    with pytest.raises(ConfigError) as error:
        load_settings(write(tmp_path, text), environ={})

    assert str(error.value) == f"{key}: must be a table ([{key}])"


def test_a_config_or_secret_file_that_is_not_utf_8_is_named(tmp_path: Path) -> None:
    """Neither the file's bytes nor a secret file's contents are echoed."""
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe\x00secret")
    config = write(tmp_path, f'[keys]\nsigning_file = "{binary}"\n')

    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(TOML files are\)$"):
        load_settings(binary, environ={})
    with pytest.raises(ConfigError) as error:
        load_settings(config, environ={})

    assert str(error.value) == f"keys.signing_file: {binary} is not UTF-8 text"


REFUSED = "is not an asymmetric signature algorithm; use some of " + ", ".join(SIGNATURE_ALGORITHMS)


@pytest.mark.parametrize(
    ("algorithms", "message"),
    [
        (["RS256", "none"], f"'none' {REFUSED}"),
        (["none"], f"'none' {REFUSED}"),
        (["HS256"], f"'HS256' {REFUSED}"),
        (["ES256", "HS512"], f"'HS512' {REFUSED}"),
        (["rs256"], f"'rs256' {REFUSED}"),
        (["ES256K"], f"'ES256K' {REFUSED}"),
        ([], "name at least one algorithm (e.g. RS256)"),
    ],
    ids=["none-beside-RS256", "none", "HS256", "HS512", "lower-case", "ES256K", "empty"],
)
def test_identity_algorithms_are_asymmetric_signatures_only(
    tmp_path: Path, algorithms: list[str], message: str
) -> None:
    """`none` would take an unsigned token for any user, and an HMAC algorithm a token keyed
    with the IdP's public key: refused as the configuration loads, from the file or the
    environment."""
    listed = f"[identity]\nalgorithms = {json.dumps(algorithms)}\n"
    in_file = write(tmp_path, VALID.replace("[identity]\n", listed))
    with pytest.raises(ConfigError) as from_file:
        load_settings(in_file, environ={})
    variable = {"BROKER_IDENTITY_ALGORITHMS": ",".join(algorithms)}
    with pytest.raises(ConfigError) as from_environment:
        load_settings(write(tmp_path, VALID), environ=variable)

    assert str(from_file.value) == str(from_environment.value) == f"identity.algorithms: {message}"


def test_every_asymmetric_signature_algorithm_is_accepted(tmp_path: Path) -> None:
    every = ",".join(SIGNATURE_ALGORITHMS)

    settings = load_settings(write(tmp_path, VALID), environ={"BROKER_IDENTITY_ALGORITHMS": every})

    assert settings.identity.algorithms == SIGNATURE_ALGORITHMS
    assert set(SIGNATURE_ALGORITHMS) <= set(JWSRegistry.algorithms)  # joserfc verifies each


def test_serve_refuses_the_none_algorithm_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)

    result = cli("serve", config_path=path, env={"BROKER_IDENTITY_ALGORITHMS": "RS256,none"})

    assert result.returncode == 2
    assert result.stderr == f"configuration error: identity.algorithms: 'none' {REFUSED}\n"


GITHUB = """
[providers.gh]
preset = "github"
client_id = "x"
client_secret_file = "{secret}"

[services.bot]
"""


def github(tmp_path: Path) -> Path:
    secret = tmp_path / "github-secret"
    secret.write_text("from-the-file\n")
    return write(tmp_path, VALID + GITHUB.format(secret=secret))


def oauth(settings: Settings, name: str = "gh") -> OAuthProviderSettings:
    provider = settings.providers[name]
    assert isinstance(provider, OAuthProviderSettings)
    return provider


def test_list_and_table_keys_take_one_string_from_the_environment(tmp_path: Path) -> None:
    """Each list key a comma list or a JSON array, each table key a JSON object, whichever
    section or named table the key is in."""
    environ = {
        "BROKER_PROVIDERS_GH_AUTHORIZE_PARAMS": '{"prompt": "consent"}',
        "BROKER_PROVIDERS_GH_TOKEN_TYPES": "bearer, mac",
        "BROKER_PROVIDERS_GH_SCOPES": '["repo", "read:user"]',
        "BROKER_SERVICES_BOT_SHARE_FROM": "mcp",
        "BROKER_SERVER_ALLOWED_ORIGINS": '["https://a.example.com", "https://b.example.com"]',
        "BROKER_IDENTITY_DEFAULT_SCOPES": "openid,profile",
    }

    settings = load_settings(github(tmp_path), environ=environ)

    assert oauth(settings).authorize_params == {"prompt": "consent"}
    assert oauth(settings).token_types == ("bearer", "mac")
    assert oauth(settings).scopes == ("repo", "read:user")
    assert settings.services["bot"].share_from == ("mcp",)
    assert settings.server.allowed_origins == ("https://a.example.com", "https://b.example.com")
    assert settings.identity.default_scopes == ("openid", "profile")


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "BROKER_PROVIDERS_GH_AUTHORIZE_PARAMS",
            "prompt=consent",
            "providers.gh.authorize_params: must be a table: as one string, a JSON object",
        ),
        (
            "BROKER_PROVIDERS_GH_AUTHORIZE_PARAMS",
            "{prompt: consent}",
            "providers.gh.authorize_params: starts with { but is not JSON: Expecting property "
            "name enclosed in double quotes",
        ),
        (
            "BROKER_SERVICES_BOT_SHARE_FROM",
            "[mcp",
            "services.bot.share_from: starts with [ but is not JSON: Expecting value",
        ),
    ],
    ids=["table-not-json", "table-bad-json", "list-bad-json"],
)
def test_a_list_or_table_from_the_environment_that_is_neither_is_named(
    tmp_path: Path, variable: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(github(tmp_path), environ={variable: value})

    assert str(error.value) == message


def test_the_environment_wins_over_the_file_and_its_secret_files(tmp_path: Path) -> None:
    """A variable for `client_secret` wins over the file's `client_secret_file`, one for
    `client_secret_file` over the file's `client_secret`; both variables at once is an error."""
    path = github(tmp_path)
    other = tmp_path / "other-secret"
    other.write_text("from-the-other-file\n")
    inline = tmp_path / "inline.toml"
    inline.write_text(path.read_text().replace("client_secret_file", "client_secret"))

    from_file = load_settings(path, environ={})
    over_file = load_settings(path, environ={"BROKER_PROVIDERS_GH_CLIENT_SECRET": "from-env"})
    over_inline = load_settings(
        inline, environ={"BROKER_PROVIDERS_GH_CLIENT_SECRET_FILE": str(other)}
    )
    with pytest.raises(ConfigError) as both:
        load_settings(
            path,
            environ={
                "BROKER_PROVIDERS_GH_CLIENT_SECRET": "from-env",
                "BROKER_PROVIDERS_GH_CLIENT_SECRET_FILE": str(other),
            },
        )

    assert oauth(from_file).client_secret.get_secret_value() == "from-the-file"
    assert oauth(over_file).client_secret.get_secret_value() == "from-env"
    assert oauth(over_inline).client_secret.get_secret_value() == "from-the-other-file"
    assert str(both.value) == (
        "BROKER_PROVIDERS_GH_CLIENT_SECRET and BROKER_PROVIDERS_GH_CLIENT_SECRET_FILE are both "
        "set; keep one"
    )
