"""`connect-broker` commands forked from a process that imported the broker once.

Every broker, replica and CLI call a test starts would otherwise be a new interpreter importing
the app's modules again, about a second of CPU each, more than most of them then spend serving.
Here a fork server (`multiprocessing`'s "forkserver": a clean process started once per test
worker, not a fork of the test process) imports the command's modules; each command is a fork of
it that sets its environment, directory and output files, then runs `app.cli.main` exactly as
`python -m app.cli` would. The child is its own process with its own event loop, sockets,
database connections and signal handlers: tests stop, kill and restart it as before.

What a fresh interpreter itself does (the `connect-broker` entry point, the README's commands,
an installed wheel) is tested by starting one: tests/test_quickstart.py, tests/test_packaging.py.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path

import httpx2

from .http import local_get

# What `serve`, `migrate` and the operator commands import, so that a fork imports nothing.
PRELOAD = [
    "app.cli",
    "app.asgi",
    "app.main",
    "app.migrate",
    "app.serving",
    "app.config_check",
    "uvicorn.main",
    "uvicorn.lifespan.on",
    "uvicorn.loops.auto",
    "uvicorn.protocols.http.auto",
    "uvicorn.protocols.websockets.auto",
    "uvicorn.loops.uvloop",
    "app.direct.batching",
    "app.direct.sqlite",
    "app.direct.postgres",
    "app.logjson",
    "anyio._backends._asyncio",
    "httpcore2",
    "httpcore2._backends.trio",  # httpx2's transport imports it, trio and all, when first built
    "truststore",
    "encodings.idna",
    "fastapi.telemetry._runtime",
    "tests.support.forked",
    "tests.support.forked_freeze",  # last: freezes what the others built
]
FORK_SERVER = multiprocessing.get_context("forkserver")
FORK_SERVER.set_forkserver_preload(PRELOAD)

_started: list[ForkedCommand] = []


class ForkedCommand:
    """The part of `subprocess.Popen` the tests use, for a forked command."""

    def __init__(self, process: BaseProcess) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(["connect-broker"], timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait_until_serving(self, url: str, log: Path, timeout: float, name: str) -> None:
        """Return once `url`/healthz answers 200; RuntimeError with the log, naming the command
        `name`, if it ends first or does not answer within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.poll() is not None:
                raise RuntimeError(f"{name} exited: {log.read_text(errors='replace')}")
            with contextlib.suppress(httpx2.HTTPError):
                if local_get(f"{url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start: {log.read_text(errors='replace')}")


def start(
    args: Sequence[str],
    *,
    stdout: Path,
    stderr: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> ForkedCommand:
    """`connect-broker ARGS`, its output appended to `stdout` (and `stderr`, else the same
    file), with the environment `env` (default: this process's) in `cwd`."""
    process = FORK_SERVER.Process(
        target=_run,
        args=(
            list(args),
            dict(os.environ if env is None else env),
            str(cwd) if cwd is not None else None,
            str(stdout),
            str(stderr if stderr is not None else stdout),
        ),
        name="connect-broker",
    )
    process.start()
    command = ForkedCommand(process)
    _started.append(command)
    return command


def run(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """`connect-broker ARGS` to its end, its output captured, like `subprocess.run(...,
    capture_output=True, text=True)`; the exit code is not checked."""
    with tempfile.TemporaryDirectory(prefix="cli-") as directory:
        out, err = Path(directory, "stdout"), Path(directory, "stderr")
        out.touch()  # read even when the fork ends before it opens them
        err.touch()
        command = start(args, stdout=out, stderr=err, env=env, cwd=cwd)
        try:
            code = command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait(5)
            raise
        return subprocess.CompletedProcess(
            ["connect-broker", *args],
            code,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )


def _run(args: list[str], env: dict[str, str], cwd: str | None, stdout: str, stderr: str) -> None:
    """In the fork: the command's environment and files, then the command."""
    import logging

    from app import cli

    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    _redirect(0, os.devnull, os.O_RDONLY)
    _redirect(1, stdout, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    _redirect(2, stderr, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    sys.argv = ["connect-broker", *args]
    try:
        code = cli.main(args)
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o600)
    os.dup2(opened, fd)
    os.close(opened)


@atexit.register
def _stop_leftovers() -> None:
    """A command a test left running would keep this process from exiting."""
    for command in _started:
        with contextlib.suppress(OSError):
            command.kill()
