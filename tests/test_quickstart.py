"""docs/quickstart.md, run as written: install, playground, the client script, the browser part.

The commands are the page's own fenced blocks, each marked `<!-- quickstart: STEP -->`; nothing
here repeats them. They run in a fresh clone of the checkout's committed state
with a virtual environment first on PATH, so `pip install` and `connect-broker` are the page's.
One change is made to them: the page's port 8000 becomes a free one. Chromium plays the reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest
from playwright.async_api import Page, async_playwright

from .e2e.conftest import ACTION_TIMEOUT_MS, CHROMIUM, CHROMIUM_ARGS
from .support.http import local_client
from .support.idp import free_port
from .test_packaging import ROOT

QUICKSTART = ROOT / "docs" / "quickstart.md"
DOC_PORT = "8000"
MARKED_BLOCK = re.compile(
    r"^<!-- quickstart: (?P<step>[^>]+?) -->\n```(?P<lang>\w+)\n(?P<body>.*?)^```$",
    re.MULTILINE | re.DOTALL,
)
ANY_CODE_BLOCK = re.compile(r"^```(\w+)$", re.MULTILINE)
STEPS = ("install", "serve", "file client.py", "run")
USER, API_KEY = "alice", "demo_abc123"
STEP_TIMEOUT = 120.0


@dataclass(frozen=True)
class Block:
    step: str
    lang: str
    body: str


def marked_blocks(markdown: str) -> list[Block]:
    return [
        Block(match["step"], match["lang"], match["body"])
        for match in MARKED_BLOCK.finditer(markdown)
    ]


def test_every_code_block_of_the_quickstart_is_marked_for_this_test() -> None:
    """A command added to the page without a marker would go untested: refuse it."""
    markdown = QUICKSTART.read_text()
    blocks = marked_blocks(markdown)

    assert [block.step for block in blocks] == list(STEPS)
    assert len(ANY_CODE_BLOCK.findall(markdown)) == len(blocks)


def test_marked_blocks_are_read_with_their_step_and_body() -> None:
    page = "x\n<!-- quickstart: run -->\n```sh\na\nb\n```\n```text\nout\n```\n"
    assert marked_blocks(page) == [Block("run", "sh", "a\nb\n")]


def quickstart_steps(port: int) -> dict[str, str]:
    """Each step's block, with the page's port replaced by `port`."""
    steps: dict[str, str] = {}
    for block in marked_blocks(QUICKSTART.read_text()):
        steps[block.step] = block.body.replace(DOC_PORT, str(port))
    assert DOC_PORT in QUICKSTART.read_text() and set(steps) == set(STEPS)
    return steps


@pytest.fixture
def checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the checkout and the environment of a reader with a fresh virtual environment
    (it sees the machine's installed packages, so `pip` finds the dependencies offline)."""
    source = tmp_path / "connect-broker"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(source)], check=True, timeout=60)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
        check=True,
        timeout=STEP_TIMEOUT,
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("BROKER_", "PYTHON"))},
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return source, env


def bash(
    script: str,
    cwd: Path,
    env: dict[str, str],
    *,
    stdin: int | None = None,
    stdout: Any,
    stderr: int,
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        text=True,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
    )


@contextlib.contextmanager
def running(process: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(10)


def installed_from(env: dict[str, str]) -> str:
    """Where the reader's `python` imports the broker from."""
    return subprocess.run(
        ["python", "-c", "import app; print(app.__file__)"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT,
        check=True,
    ).stdout


async def wait_until_serving(url: str, server: subprocess.Popen[str], log: Path) -> None:
    async with local_client(timeout=1) as http:
        for _ in range(int(STEP_TIMEOUT * 10)):
            assert server.poll() is None, log.read_text()
            with contextlib.suppress(httpx2.HTTPError):
                if (await http.get(f"{url}/healthz")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the playground did not start:\n{log.read_text()}")


async def read_link(client: subprocess.Popen[str], port: int) -> tuple[str, list[str]]:
    """The connect link the client prints, and the lines it printed."""
    assert client.stdout is not None
    lines: list[str] = []
    pattern = re.compile(rf"http://127\.0\.0\.1:{port}/connect/[A-Za-z0-9_-]+")
    while True:
        line = await asyncio.to_thread(client.stdout.readline)
        assert line, f"the client ended without a link: {lines}"
        lines.append(line)
        if found := pattern.search(line):
            return found.group(0), lines


@contextlib.asynccontextmanager
async def chromium_page() -> AsyncIterator[Page]:
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=ACTION_TIMEOUT_MS
        )
        try:
            context = await browser.new_context()
            context.set_default_timeout(ACTION_TIMEOUT_MS)
            yield await context.new_page()
        finally:
            await browser.close()


async def follow_the_link_as_the_page_says(link: str) -> str:
    """Sign in at the development sign-in page, enter the key; the heading the reader sees."""
    async with chromium_page() as page:
        await page.goto(link)
        await page.fill('input[name="username"]', USER)
        async with page.expect_navigation():
            await page.click("[data-action=dev-login]")
        assert page.url == link, page.url
        await page.fill('input[name="api_key"]', API_KEY)
        async with page.expect_navigation():
            await page.click("[data-action=submit-api-key]")
        return await page.locator("h1").inner_text()


async def test_quickstart_commands_connect_the_demo_account(
    checkout: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    source, env = checkout
    port = free_port()
    steps = quickstart_steps(port)
    installed = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", steps["install"]],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT * 3,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert installed_from(env).startswith(str(tmp_path / "venv")), "not the page's install"
    (source / "client.py").write_text(steps["file client.py"])
    log_path = tmp_path / "dev.log"

    with (
        log_path.open("w") as log,
        running(bash(steps["serve"], source, env, stdout=log, stderr=subprocess.STDOUT)) as server,
    ):
        await wait_until_serving(f"http://127.0.0.1:{port}", server, log_path)
        client = bash(
            steps["run"],
            source,
            env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        with running(client):
            async with asyncio.timeout(STEP_TIMEOUT):
                link, printed = await read_link(client, port)
                heading = await follow_the_link_as_the_page_says(link)
            assert client.stdin is not None
            rest, _ = await asyncio.to_thread(client.communicate, "\n", STEP_TIMEOUT)

    assert heading == "Demo service is connected"
    assert client.returncode == 0, "".join(printed) + rest
    assert rest.strip().splitlines()[-1] == "Demo service is connected."
