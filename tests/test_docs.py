"""The documentation stays true to the code: the generated configuration reference, the README's
commands, links between pages, and the license file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from scripts import config_reference

from .test_packaging import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
LINK = re.compile(r"\]\((?!https?://|mailto:)([^)#\s]+)(?:#[^)\s]*)?\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def test_configuration_reference_is_what_the_settings_models_generate() -> None:
    """Regenerate docs/configuration.md and compare: a new or changed key fails until the
    reference is regenerated (`python -m scripts.config_reference`)."""
    assert config_reference.TARGET == DOCS / "configuration.md"
    assert config_reference.TARGET.read_text() == config_reference.render()


def test_configuration_reference_lists_every_field_of_every_settings_model() -> None:
    rendered = config_reference.render()
    for _, model, prefix, _ in config_reference.TABLES:
        for name in model.model_fields:
            assert f"| `{prefix}.{name}` |" in rendered


def test_configuration_reference_check_mode_reports_a_stale_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration reference\n")
    monkeypatch.setattr(config_reference, "TARGET", stale)

    assert config_reference.main(["--check"]) == 1
    assert config_reference.main([]) == 0
    assert config_reference.main(["--check"]) == 0
    assert stale.read_text() == config_reference.render()


def test_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "```sh\npip install . && connect-broker dev\n```" in text
    assert "```sh\nbash scripts/test.sh\n```" in text
    assert "```mermaid\nsequenceDiagram" in text
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", pages(), ids=lambda page: page.name)
def test_relative_links_point_to_files_that_exist(page: Path) -> None:
    targets = LINK.findall(page.read_text())
    missing = [target for target in targets if not (page.parent / target).exists()]
    assert not missing


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {Path(target).name for target in LINK.findall(README.read_text())}
    assert {page.name for page in DOCS.glob("*.md")} <= linked


def test_license_is_the_apache_license_pyproject_declares() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = (ROOT / "LICENSE").read_text()

    assert project["license"] == "Apache-2.0"
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
