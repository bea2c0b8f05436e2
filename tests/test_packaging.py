"""Packaging. The container image's build stage: the files the Dockerfile copies build a complete
wheel. The sibling helper (clients/python): a wheel of its own that brings none of the broker.

Docker itself cannot run here (no daemon, and the base image comes from a registry tests may not
reach), so this rebuilds the build stage's context exactly as its COPY lines give it to
`pip wheel`, builds offline, and runs the installed code from the unpacked wheel: the command-line
entry point, the migrations and the templates must all ship inside it.
"""

from __future__ import annotations

import ast
import contextlib
import email.parser
import importlib.metadata
import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_stage_copies(dockerfile: str) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context in the first stage."""
    copies: list[tuple[list[str], str]] = []
    stages = 0
    for line in dockerfile.splitlines():
        instruction = line.split(maxsplit=1)[0].upper() if line.strip() else ""
        if instruction not in ("FROM", "COPY"):
            continue  # RUN lines may continue with a backslash, which shlex would refuse
        words = shlex.split(line, comments=True)
        if words[0].upper() == "FROM":
            stages += 1
            if stages > 1:
                break
        elif words[0].upper() == "COPY" and not any(w.startswith("--from") for w in words):
            *sources, destination = words[1:]
            copies.append((sources, destination))
    return copies


def dockerignore_admits(root: Path) -> set[str]:
    """What `.dockerignore` lets into the context: it excludes everything (`*`), then lists
    each admitted path with `!`."""
    lines = [line.strip() for line in (root / ".dockerignore").read_text().splitlines()]
    assert "*" in lines, ".dockerignore is expected to start from excluding everything"
    return {line[1:].rstrip("/") for line in lines if line.startswith("!")}


def build_context(root: Path, target: Path) -> None:
    """Copy what the build stage's COPY lines copy from `root` into `target` (the WORKDIR),
    failing as `docker build` would when `.dockerignore` keeps a source out of the context."""
    admitted = dockerignore_admits(root)
    for sources, destination in build_stage_copies((root / "Dockerfile").read_text()):
        for source in sources:
            assert source.rstrip("/") in admitted, f"{source} is not in the Docker build context"
            origin = root / source
            if destination.endswith("/"):
                placed = target / destination / origin.name
            else:
                placed = target / destination
            placed.parent.mkdir(parents=True, exist_ok=True)
            if origin.is_dir():
                shutil.copytree(origin, placed, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, placed)


def build_wheel(project: Path, wheels: Path) -> Path:
    """`pip wheel` of `project` offline, without build isolation (the installed setuptools)."""
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(wheels),
            str(project),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    [wheel] = wheels.glob("*.whl")
    return wheel


def run_installed(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python *args` from the unpacked wheel at `site`, in its parent directory (away from the
    checkout) with the database `image.db` there, as the image's command would run."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("BROKER_")},
        "PYTHONPATH": str(site),
        "BROKER_DATABASE_URL": f"sqlite:///{site.parent / 'image.db'}",
    }
    return subprocess.run(
        [sys.executable, *args],
        cwd=site.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_build_stage_copies_are_read_from_the_dockerfile() -> None:
    copies = build_stage_copies(
        "FROM base AS build\nCOPY a.toml b.md ./\nRUN make \\\n    && check\n"
        "COPY pkg ./pkg  # the code\n"
        "RUN pip wheel .\nFROM base\nCOPY --from=build /wheels /wheels\nCOPY late ./late\n"
    )
    assert copies == [(["a.toml", "b.md"], "./"), (["pkg"], "./pkg")]


def test_the_image_build_stage_context_builds_a_complete_wheel(tmp_path: Path) -> None:
    context = tmp_path / "src"
    build_context(ROOT, context)
    wheel = build_wheel(context, tmp_path / "wheels")
    assert wheel.name.startswith("connect_broker-")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(site)
    assert "app/templates/connect/api_key.html" in names
    assert "app/templates/broker.css" in names
    assert "app/migrations/env.py" in names
    assert not any(name.startswith("connect_broker_client/") for name in names)  # its own wheel
    packages = {
        init.parent.relative_to(ROOT).as_posix() for init in (ROOT / "app").rglob("__init__.py")
    }
    assert {f"{package}/__init__.py" for package in packages} <= names  # every subpackage ships
    [entry_points] = site.glob("connect_broker-*.dist-info/entry_points.txt")
    assert "connect-broker = app.cli:main" in entry_points.read_text()

    where = run_installed(
        site,
        "-c",
        "import app, app.main; from app.templating import _environment as e;"
        "e.get_template('connect/api_key.html'); print(app.__file__)",
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split())

    migrated = run_installed(site, "-m", "app.cli", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-2000:]
    assert migrated.stdout.startswith("created database schema at revision ")
    with sqlite3.connect(tmp_path / "image.db") as database:
        tables = {row[0] for row in database.execute("SELECT name FROM sqlite_master")}
    assert {"flows", "connections", "service_clients", "alembic_version"} <= tables


BROKER_ONLY = {"fastapi", "sqlalchemy", "asyncpg", "aiosqlite", "alembic", "authlib"}


def requirement_names(requirements: list[str]) -> set[str]:
    """Distribution names of `Requires-Dist` lines, those behind an extra left out."""
    names = set()
    for requirement in requirements:
        if "extra ==" in requirement:
            continue
        names.add(re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def installed_closure(names: set[str]) -> set[str]:
    """`names` and everything they require, as installed here (platform markers ignored)."""
    seen: set[str] = set()
    pending = set(names)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            pending |= requirement_names(importlib.metadata.requires(name) or [])
    return seen


def test_the_sibling_helper_builds_a_wheel_of_its_own_without_the_broker(tmp_path: Path) -> None:
    """clients/python packages the top-level connect_broker_client/ (its tests and examples
    import it from there) with `mcp` as its one dependency."""
    source = tmp_path / "src"
    shutil.copytree(ROOT / "clients" / "python", source / "clients" / "python",
                    ignore=shutil.ignore_patterns("build", "*.egg-info"))  # fmt: skip
    shutil.copytree(ROOT / "connect_broker_client", source / "connect_broker_client",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip

    wheel = build_wheel(source / "clients" / "python", tmp_path / "wheels")

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [metadata] = [name for name in names if name.endswith(".dist-info/METADATA")]
        headers = email.parser.Parser().parsestr(archive.read(metadata).decode())
    modules = {path.name for path in (ROOT / "connect_broker_client").glob("*.py")}
    assert wheel.name.startswith("connect_broker_client-")
    assert {f"connect_broker_client/{module}" for module in modules} <= names
    assert all(
        name.startswith(("connect_broker_client/", "connect_broker_client-")) for name in names
    )
    declared = requirement_names(headers.get_all("Requires-Dist") or [])
    assert declared == {"mcp"}
    assert not installed_closure(declared) & BROKER_ONLY


def test_the_sibling_helper_imports_only_what_mcp_brings() -> None:
    """Every module connect_broker_client imports is its own, the standard library's, or comes
    with its one dependency `mcp` (installed with it: mcp_types, httpx2, jwt)."""
    brought = {"mcp", "mcp_types", "httpx2", "jwt", "connect_broker_client"}
    imported: set[str] = set()
    for path in (ROOT / "connect_broker_client").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])

    assert imported - sys.stdlib_module_names - {"__future__"} <= brought
    mcp_requires = requirement_names(importlib.metadata.requires("mcp") or [])
    assert {"mcp-types", "httpx2", "pyjwt"} <= mcp_requires
