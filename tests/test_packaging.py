"""The container image's build stage: the files the Dockerfile copies build a complete wheel.

Docker itself cannot run here (no daemon, and the base image comes from a registry tests may not
reach), so this rebuilds the build stage's context exactly as its COPY lines give it to
`pip wheel`, builds offline, and runs the installed code from the unpacked wheel: the command-line
entry point, the migrations and the templates must all ship inside it.
"""

from __future__ import annotations

import os
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
    wheels = tmp_path / "wheels"

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
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]

    [wheel] = wheels.glob("connect_broker-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(site)
    assert "app/templates/connect/api_key.html" in names
    assert "app/templates/broker.css" in names
    assert "app/migrations/env.py" in names
    assert "connect_broker_client/__init__.py" in names
    [entry_points] = site.glob("connect_broker-*.dist-info/entry_points.txt")
    assert "connect-broker = app.cli:main" in entry_points.read_text()

    where = run_installed(
        site,
        "-c",
        "import app, connect_broker_client; from app.templating import _environment as e;"
        "e.get_template('connect/api_key.html');"
        "print(app.__file__); print(connect_broker_client.__file__)",
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split())

    migrated = run_installed(site, "-m", "app.cli", "migrate")
    assert migrated.returncode == 0, migrated.stderr[-2000:]
    assert migrated.stdout.startswith("created database schema at revision ")
    with sqlite3.connect(tmp_path / "image.db") as database:
        tables = {row[0] for row in database.execute("SELECT name FROM sqlite_master")}
    assert {"flows", "connections", "service_clients", "alembic_version"} <= tables
