"""docker-compose.yml runs on the first `up`: restart policies, one image for `migrate` and
`broker`, secrets as files (the database password too), health checks, a clear failure without
broker.toml, an optional TLS proxy the broker trusts, and pinned base images.

Docker has no engine here and maybe no compose plugin. The file's structure is always checked as
PyYAML reads it; where `docker compose` works, the same checks run on what `docker compose config`
renders from it as well (anchors merged, paths made absolute, the `tls` profile on).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from app.config import load_settings
from app.crypto import generate_key

from .test_packaging import installed_closure, requirement_names

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DIGEST = re.compile(r"^[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}$")
LONG_RUNNING = ("db", "broker", "caddy")
SECRET_VALUES = {
    "db_password": "db-secret-value",
    "signing_keys": generate_key("s1"),
    "encryption_keys": generate_key("e1"),
    "broker_login_client_secret": "login-secret-value",
}


def secret_names(service: dict[str, Any]) -> set[str]:
    """The secrets a service mounts (short syntax names, or rendered `source`s)."""
    return {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}


def check_structure(compose: dict[str, Any]) -> None:
    services = compose["services"]
    migrate, broker, caddy = services["migrate"], services["broker"], services["caddy"]
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped", name
    assert migrate["restart"] == "no"

    # one image, built once by `migrate` and run by `broker`
    assert "build" in migrate and "build" not in broker
    assert broker["image"] == migrate["image"]
    assert broker["pull_policy"] == "never"
    for name, service in services.items():
        if "build" not in service:
            assert name == "broker" or DIGEST.match(service["image"]), service["image"]

    # secrets as files, mapped to `_file` keys; no password inside a URL
    for name, service in services.items():
        for variable, value in service.get("environment", {}).items():
            assert "PASSWORD=" not in variable and variable != "POSTGRES_PASSWORD", name
            if "://" in str(value):
                assert urlsplit(str(value)).password is None, (name, variable)
            if variable.endswith("_FILE") and str(value).startswith("/run/secrets/"):
                secret = str(value).removeprefix("/run/secrets/")
                assert secret in secret_names(service), (name, variable)
                assert secret in compose["secrets"] and "file" in compose["secrets"][secret]
    assert services["db"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/db_password"
    for service in (migrate, broker):
        assert service["environment"]["BROKER_DATABASE_PASSWORD_FILE"] == "/run/secrets/db_password"

    # health: the image's check, not for the one-shot migration; broker waits for both
    assert migrate["healthcheck"] == {"disable": True}
    assert "healthcheck" not in broker or not broker["healthcheck"].get("disable")
    assert broker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert caddy["depends_on"]["broker"]["condition"] == "service_healthy"

    # a missing broker.toml fails instead of becoming a directory
    for service in (migrate, broker):
        [config] = [v for v in service["volumes"] if isinstance(v, dict)]
        assert config["type"] == "bind" and config["source"].endswith("broker.toml")
        assert config["target"] == "/etc/connect-broker/broker.toml"
        assert config["bind"]["create_host_path"] is False
        assert config["read_only"] is True

    # the TLS proxy: optional, and the only address the broker believes forwarded headers from
    assert caddy["profiles"] == ["tls"]
    assert "reverse-proxy" in caddy["command"] and "broker:8000" in caddy["command"]
    proxy_address = caddy["networks"]["edge"]["ipv4_address"]
    assert broker["environment"]["FORWARDED_ALLOW_IPS"] == proxy_address
    assert "edge" in broker["networks"]


def broker_environment_loads(compose: dict[str, Any], tmp_path: Path) -> None:
    """The broker's `_file` variables name real keys: with the secrets as files, the settings
    carry them, and the database password reaches only the connection URL."""
    environ = {}
    for variable, value in compose["services"]["broker"]["environment"].items():
        if str(value).startswith("/run/secrets/"):
            secret = str(value).removeprefix("/run/secrets/")
            (tmp_path / secret).write_text(SECRET_VALUES[secret] + "\n")
            value = str(tmp_path / secret)
        environ[variable] = str(value)

    settings = load_settings(None, environ=environ)

    assert settings.database.url == "postgresql://broker@db:5432/broker"
    assert "db-secret-value" in settings.database.connect_url()
    assert [k.get_secret_value() for k in settings.keys.signing] == [SECRET_VALUES["signing_keys"]]
    assert [k.get_secret_value() for k in settings.keys.encryption] == [
        SECRET_VALUES["encryption_keys"]
    ]
    assert settings.identity.login_client_secret.get_secret_value() == "login-secret-value"


def docker_compose_works() -> bool:
    if shutil.which("docker") is None:
        return False
    version = subprocess.run(
        ["docker", "compose", "version"], capture_output=True, text=True, timeout=60, check=False
    )
    return version.returncode == 0


def rendered_by_docker_compose(project: Path) -> dict[str, Any]:
    """`docker compose config` of the file in a project directory holding what it needs."""
    shutil.copy(COMPOSE, project / "docker-compose.yml")
    (project / "broker.toml").write_text("")
    (project / "secrets").mkdir()
    for name, value in SECRET_VALUES.items():
        (project / "secrets" / name).write_text(value)
    rendered = subprocess.run(
        ["docker", "compose", "--profile", "tls", "config", "--format", "json"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "BROKER_HOSTNAME": "broker.example.com"},
    )
    assert rendered.returncode == 0, rendered.stderr
    loaded: dict[str, Any] = json.loads(rendered.stdout)
    return loaded


def test_the_compose_file_runs_on_the_first_up(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    compose = yaml.safe_load(text)

    check_structure(compose)
    broker_environment_loads(compose, tmp_path)
    assert "/readyz" in text and "/healthz" in text  # documented for load balancers
    if docker_compose_works():
        project = tmp_path / "project"
        project.mkdir()
        check_structure(rendered_by_docker_compose(project))


def test_the_image_checks_liveness_after_a_start_period_from_a_pinned_base() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    [healthcheck] = [line for line in dockerfile.splitlines() if line.startswith("HEALTHCHECK")]
    [base] = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, flags=re.MULTILINE)
    froms = [line for line in dockerfile.splitlines() if line.startswith("FROM")]

    assert "/healthz" in healthcheck and "--start-period=" in healthcheck
    assert DIGEST.match(base)
    assert froms and all(line.startswith("FROM ${PYTHON_IMAGE}") for line in froms)


def test_the_image_installs_no_reload_only_packages() -> None:
    """The broker's dependencies, as the image's `pip wheel .` resolves them: uvicorn without its
    [standard] extra (watchfiles is for --reload), but with its fast loop and HTTP parser."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dependencies: list[str] = project["dependencies"]
    closure = installed_closure(requirement_names(dependencies))

    assert not any(re.match(r"uvicorn\[", requirement) for requirement in dependencies)
    assert "watchfiles" not in closure
    assert {"uvicorn", "uvloop", "httptools"} <= closure
