"""OAuth provider configuration: presets, generic `oauth2`/`oidc` tables, errors naming the key.

Most tests load TOML text with `app.config.load_settings` and start nothing; `check-config` runs
the CLI, and `list_providers` asks the session broker what it was configured with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest

from app.config import ConfigError, Settings, load_settings
from app.crypto import generate_key
from app.providers.presets import PRESETS
from app.providers.settings import OAuthProviderSettings, PresetName

from .support.broker import cli, drop_database, fresh_database
from .support.clients import McpHttp
from .support.idp import IdpProcess
from .support.schema import validate_response

CLIENT = 'client_id = "the-client-id"\nclient_secret = "the-client-secret"\n'
URL_KEYS = ("authorize_url", "token_url", "userinfo_url", "revocation_url", "api_base_url")

# What each preset must provide, written out here rather than read from PRESETS, so a wrong
# default in app/providers/presets.py fails a test: (kind, display_name, authorize_url,
# token_url, default scopes).
EXPECTED_PRESETS: dict[str, tuple[str, str, str, str, tuple[str, ...]]] = {
    "github": (
        "oauth2",
        "GitHub",
        "https://github.com/login/oauth/authorize",
        "https://github.com/login/oauth/access_token",
        ("read:user",),
    ),
    "gitlab": (
        "oauth2",
        "GitLab",
        "https://gitlab.com/oauth/authorize",
        "https://gitlab.com/oauth/token",
        ("read_user",),
    ),
    "google": (
        "oidc",
        "Google",
        "https://accounts.google.com/o/oauth2/v2/auth",
        "https://oauth2.googleapis.com/token",
        ("openid", "email"),
    ),
    "slack": (
        "oauth2",
        "Slack",
        "https://slack.com/oauth/v2/authorize",
        "https://slack.com/api/oauth.v2.access",
        ("users:read",),
    ),
    "microsoft": (
        "oauth2",
        "Microsoft",
        "https://login.microsoftonline.com/common/oauth2/v2.0/authorize",
        "https://login.microsoftonline.com/common/oauth2/v2.0/token",
        ("openid", "profile", "email", "offline_access", "User.Read"),
    ),
    "atlassian": (
        "oauth2",
        "Atlassian",
        "https://auth.atlassian.com/authorize",
        "https://auth.atlassian.com/oauth/token",
        ("read:me", "offline_access"),
    ),
    "linear": (
        "oauth2",
        "Linear",
        "https://linear.app/oauth/authorize",
        "https://api.linear.app/oauth/token",
        ("read",),
    ),
    "notion": (
        "oauth2",
        "Notion",
        "https://api.notion.com/v1/oauth/authorize",
        "https://api.notion.com/v1/oauth/token",
        (),
    ),
}


ACME_TABLES = """
[providers.acme]
kind = "oidc"
display_name = "Acme"
issuer = "https://id.acme.example"
client_id = "broker"
client_secret = "acme-file-secret"

[providers.acme_eu]
kind = "oidc"
display_name = "Acme EU"
issuer = "https://id.eu.acme.example"
client_id = "broker"
"""


def to_toml(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f'"{item}"' for item in value) + "]"
    return f'"{value}"'


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> Settings:
    path = tmp_path / "broker.toml"
    path.write_text(text)
    return load_settings(path, environ=environ or {})


def oauth(settings: Settings, name: str) -> OAuthProviderSettings:
    provider = settings.providers[name]
    assert isinstance(provider, OAuthProviderSettings)
    return provider


def refusal(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as error:
        load(tmp_path, text)
    return str(error.value)


def test_the_expectations_cover_every_preset() -> None:
    """Our decision: a preset added to the code gets its defaults checked here too."""
    assert set(EXPECTED_PRESETS) == set(get_args(PresetName)) == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(EXPECTED_PRESETS))
def test_a_preset_with_client_credentials_alone_is_a_complete_provider(
    tmp_path: Path, preset: str
) -> None:
    """DESIGN §4: `preset = "github"` supplies kind, endpoints, scopes and name; only the OAuth
    app's credentials are the operator's to give."""
    kind, display_name, authorize_url, token_url, scopes = EXPECTED_PRESETS[preset]

    provider = oauth(load(tmp_path, f'[providers.x]\npreset = "{preset}"\n{CLIENT}'), "x")

    assert provider.kind == kind
    assert provider.preset == preset
    assert provider.display_name == display_name
    assert (provider.authorize_url, provider.token_url) == (authorize_url, token_url)
    assert provider.scopes == scopes
    assert provider.client_id == "the-client-id"
    assert provider.client_secret.get_secret_value() == "the-client-secret"
    assert "the-client-secret" not in repr(provider)
    assert provider.pkce is True


@pytest.mark.parametrize("preset", sorted(EXPECTED_PRESETS))
def test_every_preset_endpoint_is_https(tmp_path: Path, preset: str) -> None:
    """RFC 6749 §3.1, §3.2: codes, tokens and the client secret travel only over TLS."""
    provider = oauth(load(tmp_path, f'[providers.x]\npreset = "{preset}"\n{CLIENT}'), "x")

    urls = [getattr(provider, key) for key in (*URL_KEYS, "issuer")]

    assert all(url is None or url.startswith("https://") for url in urls), urls


def test_presets_carry_the_provider_quirks(tmp_path: Path) -> None:
    """Each quirk below breaks the provider if missing (comma scopes, Basic auth, no RFC 7009)."""
    text = "".join(f'[providers.{name}]\npreset = "{name}"\n{CLIENT}' for name in PRESETS)

    settings = load(tmp_path, text)

    github = oauth(settings, "github")
    assert (github.scope_separator, github.revocation) == (",", "github")
    assert (github.account_label_claim, github.account_label_prefix) == ("login", "@")
    assert github.api_base_url == "https://api.github.com"
    assert oauth(settings, "google").issuer == "https://accounts.google.com"
    assert oauth(settings, "google").authorize_params["access_type"] == "offline"
    slack = oauth(settings, "slack")
    assert (slack.scope_separator, slack.scope_parameter) == (",", "user_scope")
    assert (slack.token_member, slack.token_types) == ("authed_user", ("user",))
    assert oauth(settings, "linear").scope_separator == ","
    assert oauth(settings, "notion").client_auth_method == "client_secret_basic"
    assert oauth(settings, "notion").authorize_params == {"owner": "user"}
    assert oauth(settings, "atlassian").authorize_params["audience"] == "api.atlassian.com"
    assert "email" in oauth(settings, "microsoft").scopes  # userinfo's email is the label
    assert oauth(settings, "microsoft").account_label_claim == "email"


def test_a_preset_with_its_own_kind_loads_the_same(tmp_path: Path) -> None:
    """The session broker's GitHub table names both; that must not change anything."""
    plain = oauth(load(tmp_path, f'[providers.x]\npreset = "github"\n{CLIENT}'), "x")
    explicit = oauth(
        load(tmp_path, f'[providers.x]\nkind = "oauth2"\npreset = "github"\n{CLIENT}'), "x"
    )

    assert plain == explicit


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("authorize_url", "http://127.0.0.1:8001/login/oauth/authorize"),
        ("token_url", "https://ghe.example.com/login/oauth/access_token"),
        ("userinfo_url", "https://ghe.example.com/api/v3/user"),
        ("revocation_url", "https://ghe.example.com/revoke"),
        ("api_base_url", "https://ghe.example.com/api/v3"),
        ("display_name", "GitHub Enterprise"),
        ("scopes", ["repo", "read:org"]),
        ("scope_separator", " "),
        ("account_label_claim", "name"),
    ],
)
def test_any_preset_value_can_be_overridden(tmp_path: Path, key: str, value: Any) -> None:
    """The preset's docstring: every key given in the table overrides the preset's."""
    text = f'[providers.x]\npreset = "github"\n{CLIENT}{key} = {to_toml(value)}\n'

    provider = oauth(load(tmp_path, text), "x")

    expected = tuple(value) if isinstance(value, list) else value
    assert getattr(provider, key) == expected
    others = {k: v for k, v in PRESETS["github"].items() if k not in (key, "kind")}
    for other, preset_value in others.items():  # nothing else moved
        actual = getattr(provider, other)
        assert actual == (tuple(preset_value) if isinstance(preset_value, list) else preset_value)


def test_an_oidc_preset_issuer_can_be_overridden(tmp_path: Path) -> None:
    text = f'[providers.x]\npreset = "google"\n{CLIENT}issuer = "https://127.0.0.1:9443"\n'

    provider = oauth(load(tmp_path, text), "x")

    assert (provider.kind, provider.issuer) == ("oidc", "https://127.0.0.1:9443")


def test_a_generic_oidc_provider_needs_only_an_issuer_and_a_client(tmp_path: Path) -> None:
    """Its endpoints come from the issuer's discovery document at run time; it asks for the
    `openid` scope, without which no ID token comes back."""
    provider = oauth(load(tmp_path, ACME_TABLES), "acme")

    assert (provider.kind, provider.issuer, provider.display_name) == (
        "oidc",
        "https://id.acme.example",
        "Acme",
    )
    assert provider.authorize_url is None and provider.token_url is None
    assert provider.scopes == ("openid",)


@pytest.mark.parametrize(
    "table",
    [
        f'kind = "oidc"\ndisplay_name = "X"\nissuer = "https://x.example"\n{CLIENT}',
        f'preset = "google"\n{CLIENT}',
    ],
    ids=["generic", "google-preset"],
)
def test_an_oidc_provider_without_the_openid_scope_is_refused(tmp_path: Path, table: str) -> None:
    """OIDC Core §3.1.2.1: without `openid` there is no ID token to check, so every exchange
    would fail; the configuration says so at start instead."""
    text = f'[providers.x]\n{table}scopes = ["profile", "email"]\n'

    assert refusal(tmp_path, text) == (
        "providers.x.scopes: an oidc provider must ask for the openid scope"
    )


def test_an_oauth2_provider_may_have_no_scopes(tmp_path: Path) -> None:
    """Notion has none; plain OAuth 2.0 gets no `openid` added."""
    provider = oauth(load(tmp_path, f'[providers.x]\npreset = "notion"\n{CLIENT}'), "x")

    assert provider.scopes == ()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            'kind = "oauth2"\ndisplay_name = "X"\n',
            "providers.x: an oauth2 provider needs authorize_url and token_url",
        ),
        (
            'kind = "oauth2"\ndisplay_name = "X"\nauthorize_url = "https://x.example/authorize"\n',
            "providers.x: an oauth2 provider needs authorize_url and token_url",
        ),
        (
            'kind = "oauth2"\ndisplay_name = "X"\ntoken_url = "https://x.example/token"\n',
            "providers.x: an oauth2 provider needs authorize_url and token_url",
        ),
        ('kind = "oidc"\ndisplay_name = "X"\n', "providers.x: an oidc provider needs issuer"),
    ],
    ids=["oauth2-nothing", "oauth2-no-token-url", "oauth2-no-authorize-url", "oidc-no-issuer"],
)
def test_a_generic_provider_without_its_endpoints_is_refused(
    tmp_path: Path, table: str, message: str
) -> None:
    """DESIGN §4: a wrong config fails at start with a message naming the key."""
    assert refusal(tmp_path, f"[providers.x]\n{table}{CLIENT}") == message


@pytest.mark.parametrize("key", [*URL_KEYS, "issuer"])
@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://user:secret@x.example/path", "without user info"),
        ("ftp://x.example/path", "absolute http(s) URL"),
        ("/relative/path", "absolute http(s) URL"),
        ("https://x.example/path#fragment", "absolute http(s) URL"),
        ("http://x.example/path", "must use https"),
    ],
    ids=["userinfo", "ftp", "relative", "fragment", "plain-http"],
)
def test_a_bad_provider_url_is_refused_naming_the_field(
    tmp_path: Path, key: str, url: str, reason: str
) -> None:
    """DESIGN §4 and T16: provider URLs are configuration, checked at start, named on error."""
    text = f'[providers.x]\npreset = "google"\n{CLIENT}{key} = "{url}"\n'

    message = refusal(tmp_path, text)

    assert message.startswith(f"providers.x.{key}: "), message
    assert reason in message


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/token", "http://localhost/token"])
def test_plain_http_is_allowed_for_a_loopback_provider(tmp_path: Path, url: str) -> None:
    """Local test and development providers (like this suite's) run without TLS."""
    text = f'[providers.x]\npreset = "github"\n{CLIENT}token_url = "{url}"\n'

    assert oauth(load(tmp_path, text), "x").token_url == url


@pytest.mark.parametrize(
    "table",
    ['preset = "gitbub"\n', 'kind = "oauth2"\npreset = "gitbub"\n'],
    ids=["without-kind", "with-kind"],
)
def test_an_unknown_preset_is_refused_naming_the_preset(tmp_path: Path, table: str) -> None:
    message = refusal(tmp_path, f"[providers.x]\n{table}{CLIENT}")

    assert message.startswith("providers.x.preset: "), message
    assert "'github'" in message and "'notion'" in message  # the choices are listed


def test_the_client_secret_can_come_from_the_environment(tmp_path: Path) -> None:
    """DESIGN §4: BROKER_PROVIDERS_<NAME>_<KEY> overrides the table (secrets stay out of files)."""
    text = f'[providers.github]\npreset = "github"\nclient_id = "the-client-id"\n{ACME_TABLES}'
    environ = {
        "BROKER_PROVIDERS_GITHUB_CLIENT_SECRET": "secret-from-env",
        "BROKER_PROVIDERS_ACME_EU_CLIENT_SECRET": "eu-secret-from-env",
        "BROKER_PROVIDERS_GITHUB_SCOPES": '["repo", "read:org"]',
    }

    settings = load(tmp_path, text, environ)

    github = oauth(settings, "github")
    assert github.client_secret.get_secret_value() == "secret-from-env"
    assert github.scopes == ("repo", "read:org")
    assert oauth(settings, "acme_eu").client_secret.get_secret_value() == "eu-secret-from-env"
    assert oauth(settings, "acme").client_secret.get_secret_value() == "acme-file-secret"


def test_an_environment_value_for_an_unknown_provider_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        load(tmp_path, ACME_TABLES, {"BROKER_PROVIDERS_GITHUB_CLIENT_SECRET": "x"})

    assert str(error.value).startswith("BROKER_PROVIDERS_GITHUB_CLIENT_SECRET: ")


def test_check_config_accepts_a_preset_and_a_generic_oidc_provider(
    tmp_path: Path, idp: IdpProcess
) -> None:
    """check-config asks the IdP and the database too: a live IdP, a migrated database."""
    keys = f'signing = ["{generate_key("s1")}"]\nencryption = ["{generate_key("e1")}"]\n'
    database = fresh_database(tmp_path, "providers")
    text = (
        '[server]\npublic_url = "https://broker.example.com"\n'
        f'[database]\nurl = "{database}"\n'
        f'[identity]\nissuer = "{idp.issuer}"\nlogin_client_id = "broker"\n'
        'login_client_secret = "the-login-secret"\n'
        f"[keys]\n{keys}"
        f'[providers.github]\npreset = "github"\n{CLIENT}'
        f"{ACME_TABLES}"
    )
    path = tmp_path / "broker.toml"
    path.write_text(text)
    try:
        assert cli("migrate", config_path=path).returncode == 0
        result = cli("check-config", config_path=path)
    finally:
        drop_database(database)

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("configuration OK")
    assert "3 provider(s)" in result.stdout
    assert "the-client-secret" not in result.stdout + result.stderr


async def test_list_providers_names_each_kind_with_its_display_name(
    mcp: McpHttp, token_for: Any
) -> None:
    """DESIGN §4 `list_providers`: the session broker's API-key, preset and generic OIDC
    providers, each with its kind and the name users see."""
    response = await mcp.call_tool(token_for("provider-lister"), "list_providers")

    body = response.json()
    validate_response(body, "CallToolResult")
    listed = {item["name"]: item for item in body["result"]["structuredContent"]["providers"]}
    assert {name: listed.get(name) for name in ("demo", "github", "acme")} == {
        "demo": {"name": "demo", "kind": "api_key", "display_name": "Demo", "connected": False},
        "github": {
            "name": "github",
            "kind": "oauth2",
            "display_name": "GitHub",
            "connected": False,
        },
        "acme": {"name": "acme", "kind": "oidc", "display_name": "Acme", "connected": False},
    }
