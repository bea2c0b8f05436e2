"""Driving `connect-broker dev` and its companion commands as a user would, in processes of
their own (forked: tests/support/forked.py)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx2

from . import forked
from .clients import Browser

ROOT = Path(__file__).resolve().parent.parent.parent
START_TIMEOUT = 30


def cli_env() -> dict[str, str]:
    """This checkout's `app` on the path, wherever the command runs."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`connect-broker *args` run in `cwd` (forked: tests/support/forked.py), its output
    captured; the exit code is not checked."""
    return forked.run(args, cwd=cwd, env=cli_env())


@contextlib.contextmanager
def running_dev(cwd: Path, port: int, *args: str) -> Iterator[tuple[str, Path]]:
    """`connect-broker dev --port PORT *args` in `cwd` (forked: tests/support/forked.py) until
    /healthz answers: (URL, its log)."""
    log_path = cwd / "dev.log"
    log_path.write_bytes(b"")
    process = forked.start(
        ["dev", "--port", str(port), *args], stdout=log_path, cwd=cwd, env=cli_env()
    )
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_until_serving(url, log_path, START_TIMEOUT, "connect-broker dev")
        yield url, log_path
    finally:
        process.terminate()
        process.wait(10)


async def dev_login(browser: Browser, user: str, next_path: str) -> httpx2.Response:
    """Sign `browser` in at the playground's development IdP (any user name, no password):
    the broker's answer to the IdP's redirect back."""
    start = await browser.get("/login", params={"next": next_path})
    assert start.status_code == 303, start.text
    form = await browser.http.get(start.headers["location"])
    fields = dict(re.findall(r'type="hidden" name="([^"]+)" value="([^"]*)"', form.text))
    back = await browser.http.post(
        f"{browser.broker_url}/dev-idp/authorize", data={**fields, "username": user}
    )
    callback = urlsplit(back.headers["location"])
    signed_in = await browser.get(f"{callback.path}?{callback.query}")
    assert signed_in.status_code == 303, signed_in.text
    return signed_in
