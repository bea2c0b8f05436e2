"""GET / answers a small page saying what the broker is, with links onwards, not a JSON 404."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import ConfigError, load_settings

from .support.broker import BrokerConfig, BrokerProcess, running_broker
from .support.http import local_client
from .support.idp import IdpProcess

DOCS = "https://docs.example/connect-broker"


async def test_the_root_shows_the_landing_page(broker: BrokerProcess) -> None:
    async with local_client() as http:
        response = await http.get(f"{broker.url}/")

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.headers["content-security-policy"].startswith("default-src 'none'")
    assert "<h1>Connect Broker</h1>" in response.text
    assert '<a href="/connections">your connections</a>' in response.text
    assert "<code>connect-broker --help</code>" in response.text  # no docs_url configured


async def test_the_landing_page_links_the_configured_docs(idp: IdpProcess, workdir: Path) -> None:
    config = BrokerConfig(issuer=idp.issuer, extra={"server": {"docs_url": DOCS}})
    with running_broker(config, workdir, name="docs-url") as broker:
        async with local_client() as http:
            response = await http.get(f"{broker.url}/")

    assert response.status_code == 200
    assert f'Read <a href="{DOCS}">the documentation</a>.' in response.text


def test_docs_url_must_be_an_absolute_http_url() -> None:
    with pytest.raises(ConfigError) as error:
        load_settings(environ={"BROKER_SERVER_DOCS_URL": "javascript:alert(1)"})

    assert str(error.value) == "server.docs_url: must be an absolute http(s) URL"
