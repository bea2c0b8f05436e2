"""`connect-broker dev --config FILE --data-dir DIR`: the user's own providers and services in the
playground, its companion commands from another directory, a busy port, the printed client
configuration and the development banner on every page."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .oauth.helpers import connect, open_flow, retry_connect
from .support.broker import BrokerProcess
from .support.clients import Browser, McpHttp
from .support.fake_github import FakeGitHub
from .support.idp import free_port
from .support.playground import cli, cli_env, dev_login, running_dev

BANNER = "Development playground — not for production"


@dataclass(frozen=True)
class Playground:
    url: str
    port: int
    home: Path  # where `dev` ran
    data_dir: Path
    log: Path
    elsewhere: Path  # another directory, for the companion commands


@pytest.fixture(scope="module")
def github(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FakeGitHub, int]]:
    port = free_port()
    with FakeGitHub(redirect_uri=f"http://127.0.0.1:{port}/oauth/github/callback") as fake:
        yield fake, port


@pytest.fixture(scope="module")
def playground(
    tmp_path_factory: pytest.TempPathFactory, github: tuple[FakeGitHub, int]
) -> Iterator[Playground]:
    fake, port = github
    home, elsewhere = tmp_path_factory.mktemp("dev-home"), tmp_path_factory.mktemp("elsewhere")
    (home / "my-broker.toml").write_text(
        textwrap.dedent(
            f"""\
            [identity]
            issuer = "https://idp.example.com"  # the playground keeps its own

            [providers.github]
            preset = "github"
            client_id = "{fake.client_id}"
            client_secret_file = "github-secret.txt"
            authorize_url = "{fake.authorize_url}"
            token_url = "{fake.token_url}"
            userinfo_url = "{fake.url}/user"
            api_base_url = "{fake.url}"

            [services.notes]
            display_name = "Notes"
            """
        )
    )
    (home / "github-secret.txt").write_text(fake.client_secret)
    args = ("--config", "my-broker.toml", "--data-dir", "state")
    with running_dev(home, port, *args) as (url, log):
        yield Playground(url, port, home, home / "state", log, elsewhere)


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` and a digest of its content; the running playground's own
    database (which it writes on its own) by name only."""
    return {
        str(path.relative_to(directory)): (
            "live"
            if path.name.startswith("dev.db")
            else hashlib.sha256(path.read_bytes()).hexdigest()
        )
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def printed_block(log: str, heading: str, following: str) -> str:
    """The indented snippet `dev` printed between two headings, dedented."""
    block = log.split(f"{heading}\n", 1)[1].split(f"\n{following}", 1)[0]
    return textwrap.dedent(block)


def test_the_config_files_providers_join_the_playground_for_service_create_elsewhere(
    playground: Playground,
) -> None:
    data_dir = str(playground.data_dir)

    created = cli(playground.elsewhere, "service", "create", "notes", "--providers", "github",
                  "--data-dir", data_dir)  # fmt: skip
    listed = cli(playground.elsewhere, "service", "list", "--data-dir", data_dir)

    assert created.returncode == 0, created.stderr
    assert re.fullmatch(r"\S{20,}\n", created.stdout)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == "notes\tgithub\tactive\n"
    assert not (playground.elsewhere / "data").exists()


async def test_a_dev_token_from_elsewhere_connects_the_config_files_github_end_to_end(
    playground: Playground, github: tuple[FakeGitHub, int]
) -> None:
    """The user's own OAuth app (here the fake GitHub) behind the playground's development IdP,
    with the callback at http://127.0.0.1:<port>/oauth/github/callback."""
    fake, _ = github
    minted = cli(playground.elsewhere, "dev-token", "carol", "--data-dir", str(playground.data_dir))
    assert minted.returncode == 0, minted.stderr
    token = minted.stdout.strip()
    mcp, browser = McpHttp(f"{playground.url}/mcp"), Browser(playground.url)
    try:
        opened = await open_flow(mcp, token)
        await dev_login(browser, "carol", f"/connect/{opened.flow_id}")
        consent = await browser.get(f"/connect/{opened.flow_id}")
        callback_url, landed = await connect(browser, opened.flow_id)
        connections = await browser.get("/connections")
        retried = await retry_connect(mcp, token, opened)
    finally:
        await mcp.aclose()
        await browser.aclose()

    assert callback_url.startswith(f"{playground.url}/oauth/github/callback?")
    assert landed.status_code == 303, landed.text
    assert retried.json()["result"]["structuredContent"]["status"] == "connected"
    assert fake.token_calls >= 1
    assert consent.status_code == 200 and BANNER in consent.text
    assert connections.status_code == 200 and BANNER in connections.text
    assert "GitHub" in connections.text


def test_dev_prints_the_data_dir_and_configurations_for_the_official_sdks(
    playground: Playground,
) -> None:
    log = playground.log.read_text()
    token = re.search(r"Bearer token for 'alice' \(12 h\): (\S+)", log)
    assert token
    mcp_url = f"{playground.url}/mcp"
    python = printed_block(log, "Python (mcp 2.x):", "TypeScript")
    typescript = printed_block(log, "TypeScript (@modelcontextprotocol/client 2.x):", "Any client")
    servers = json.loads(log.split("Any client with an mcpServers file:\n", 1)[1].split("\n}\n")[0]
                         + "\n}")  # fmt: skip

    ran = subprocess.run(
        [sys.executable, "-c", python],
        cwd=playground.elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=cli_env(),
    )

    assert f"Data dir     : {playground.data_dir.resolve()}" in log
    assert f"--data-dir {playground.data_dir.resolve()}" in log
    assert "Your providers: github" in log
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "connect_account" in ran.stdout
    assert "from '@modelcontextprotocol/client'" in typescript
    assert f"new StreamableHTTPClientTransport(new URL('{mcp_url}')" in typescript
    assert f"Authorization: 'Bearer {token.group(1)}'" in typescript
    assert servers["mcpServers"]["connect-broker-dev"] == {
        "type": "http",
        "url": mcp_url,
        "headers": {"Authorization": f"Bearer {token.group(1)}"},
    }
    secrets = json.loads((playground.data_dir / "dev.json").read_text())
    for secret in (secrets["signing"], secrets["encryption"], secrets["login_secret"]):
        assert secret.split(":")[-1] not in log
    assert (playground.home / "github-secret.txt").read_text() not in log


def test_dev_on_a_busy_port_changes_nothing_and_says_so_in_one_line(
    playground: Playground, tmp_path: Path
) -> None:
    before = snapshot(playground.data_dir)

    again = cli(playground.elsewhere, "dev", "--port", str(playground.port),
                "--data-dir", str(playground.data_dir))  # fmt: skip
    fresh = cli(tmp_path, "dev", "--port", str(playground.port))

    assert again.returncode == 1 and fresh.returncode == 1
    assert again.stdout == "" and again.stderr.count("\n") == 1
    assert f"port {playground.port} on 127.0.0.1 is in use" in again.stderr
    assert "--port" in again.stderr
    assert snapshot(playground.data_dir) == before
    assert list(tmp_path.iterdir()) == []


def test_dev_on_a_port_taken_by_another_program_writes_no_data_dir(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = cli(tmp_path, "dev", "--port", str(taken.getsockname()[1]))

    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "is in use" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_companion_commands_without_a_playground_say_where_they_looked(tmp_path: Path) -> None:
    token = cli(tmp_path, "dev-token", "bob", "--data-dir", "nowhere")
    listing = cli(tmp_path, "service", "list", "--data-dir", "nowhere")

    for result in (token, listing):
        assert result.returncode == 2 and result.stdout == ""
        assert f"no playground in {tmp_path / 'nowhere'}" in result.stderr
        assert "connect-broker dev" in result.stderr
    assert list(tmp_path.iterdir()) == []


async def test_serve_pages_carry_no_development_banner(
    broker: BrokerProcess, token_for: Any
) -> None:
    mcp, browser = McpHttp(broker.mcp_url), Browser(broker.url)
    try:
        opened = await open_flow(mcp, token_for("serve-banner"))
        await browser.login_as("serve-banner", next_path=f"/connect/{opened.flow_id}")
        consent = await browser.get(f"/connect/{opened.flow_id}")
        connections = await browser.get("/connections")
    finally:
        await mcp.aclose()
        await browser.aclose()

    assert consent.status_code == 200 and "GitHub" in consent.text
    assert connections.status_code == 200 and "Connect Broker" in connections.text
    assert BANNER not in consent.text and BANNER not in connections.text


@pytest.mark.parametrize("source", ["file", "environment"])
def test_dev_writes_the_log_format_the_configuration_names(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`logging.format` applies to `dev` as to `serve`: from `dev --config FILE`, or from
    BROKER_LOGGING_FORMAT without a file."""
    args: tuple[str, ...] = ()
    if source == "file":
        (tmp_path / "mine.toml").write_text('[logging]\nformat = "json"\n')
        args = ("--config", "mine.toml")
    else:
        monkeypatch.setenv("BROKER_LOGGING_FORMAT", "json")

    with running_dev(tmp_path, free_port(), *args) as (_url, log):
        pass

    text = log.read_text()
    records = [json.loads(line) for line in text.splitlines() if line.startswith('{"time"')]
    messages = {record["message"] for record in records}
    assert {"Application startup complete.", "Application shutdown complete."} <= messages, text
    assert " INFO uvicorn.error " not in text  # no plain line
