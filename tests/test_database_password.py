"""`database.password` (BROKER_DATABASE_PASSWORD_FILE in the compose file): PostgreSQL's password
from a mounted secret, kept out of `database.url` and merged in only where connections open."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from app import cli
from app.config import ConfigError, load_settings
from app.crypto import generate_key
from app.main import create_app

PASSWORD = "p@ss:w/rd%?#"  # every character a URL would need escaped
URL = "postgresql://broker@127.0.0.1:5432/broker"


def password_file(tmp_path: Path, content: str = f"{PASSWORD}\n") -> str:
    path = tmp_path / "db-password"
    path.write_text(content)
    return str(path)


def test_the_password_file_is_merged_into_the_url_only_for_connecting(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        environ={
            "BROKER_DATABASE_URL": URL,
            "BROKER_DATABASE_PASSWORD_FILE": password_file(tmp_path),
        },
    )

    assert settings.database.url == URL
    assert PASSWORD not in repr(settings.database)
    merged = make_url(settings.database.connect_url())
    assert merged.password == PASSWORD
    assert (merged.username, merged.host, merged.port, merged.database) == (
        "broker",
        "127.0.0.1",
        5432,
        "broker",
    )


def test_without_a_password_the_url_is_used_as_it_is() -> None:
    settings = load_settings(None, environ={"BROKER_DATABASE_URL": URL})

    assert settings.database.connect_url() == URL


@pytest.mark.parametrize(
    ("url", "content", "message"),
    [
        ("sqlite:///./data/broker.db", PASSWORD, "only for a postgresql:// database.url"),
        ("postgresql://broker:other@db/broker", PASSWORD, "carries a password already"),
        (URL, "\n", "is empty"),
        ("not a url", PASSWORD, "database.url is not a database URL"),
    ],
)
def test_a_password_the_url_cannot_take_is_refused_naming_the_key(
    tmp_path: Path, url: str, content: str, message: str
) -> None:
    environ = {
        "BROKER_DATABASE_URL": url,
        "BROKER_DATABASE_PASSWORD_FILE": password_file(tmp_path, content),
    }
    with pytest.raises(ConfigError) as raised:
        load_settings(None, environ=environ)

    assert str(raised.value).startswith("database.password: ")
    assert message in str(raised.value)
    assert PASSWORD not in str(raised.value)


def test_the_broker_and_migrate_connect_with_the_merged_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    environ = {"BROKER_DATABASE_URL": URL, "BROKER_DATABASE_PASSWORD_FILE": password_file(tmp_path)}
    settings = load_settings(
        None,
        environ=environ,
        overrides={
            "identity.issuer": "https://idp.example.com",
            "keys.signing": [generate_key("s1")],
            "keys.encryption": [generate_key("e1")],
        },
    )
    migrated: list[str] = []
    monkeypatch.setattr("app.migrate.upgrade", migrated.append)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)

    app = create_app(settings)
    (tmp_path / "broker.toml").write_text("")
    code = cli.main(["--config", str(tmp_path / "broker.toml"), "migrate"])

    assert app.state.engine.url.password == PASSWORD
    assert code == 0
    assert [make_url(url).password for url in migrated] == [PASSWORD]
