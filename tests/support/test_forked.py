"""The forked `connect-broker` commands behave as the started interpreter did."""

from __future__ import annotations

import importlib.util
import os
import signal
from pathlib import Path

from . import forked
from .idp import free_port


def test_every_preloaded_module_exists() -> None:
    """The fork server skips a module it cannot import without a word."""
    assert [name for name in forked.PRELOAD if importlib.util.find_spec(name) is None] == []


def test_a_command_gets_its_arguments_environment_and_directory(tmp_path: Path) -> None:
    (tmp_path / "broker.toml").write_text("[server\n")

    result = forked.run(
        ["check-config"], env={**os.environ, "BROKER_CONFIG": "broker.toml"}, cwd=tmp_path
    )

    assert result.returncode == 2
    assert result.stdout == ""
    # read from the directory, through the variable: found, and refused for what it holds
    assert result.stderr.startswith("configuration error: broker.toml is not valid TOML")


def test_output_and_the_exit_code_are_the_commands(tmp_path: Path) -> None:
    result = forked.run(["keys", "generate"], cwd=tmp_path)
    refused = forked.run(["no-such-command"], cwd=tmp_path)

    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.startswith("[keys]\nsigning = [")
    assert refused.returncode == 2
    assert "invalid choice: 'no-such-command'" in refused.stderr


def test_a_running_command_is_killed_and_its_end_seen(tmp_path: Path) -> None:
    log = tmp_path / "dev.log"
    port = free_port()
    command = forked.start(["dev", "--port", str(port)], stdout=log, cwd=tmp_path)
    try:
        command.wait_until_serving(f"http://127.0.0.1:{port}", log, 30, "dev")
        assert command.poll() is None
        assert command.pid != os.getpid()
    finally:
        command.kill()

    assert command.wait(10) == -signal.SIGKILL
    command.kill()  # after its end: nothing to signal, no error
