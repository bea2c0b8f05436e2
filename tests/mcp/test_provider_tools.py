"""`github_whoami`'s result is built from the provider's `/user` answer, which is checked first:
only the named fields, each an integer or a readable bounded string (app/mcp/provider_tools.py)."""

from __future__ import annotations

from app.display import NAME_LIMIT
from app.mcp.provider_tools import _profile


def test_only_the_named_fields_are_kept_and_plain_values_pass_unchanged() -> None:
    answer = {"login": "octocat", "id": 583231, "name": "The Octocat", "token": "gho_secret"}

    assert _profile(answer) == {"login": "octocat", "id": 583231, "name": "The Octocat"}


def test_hidden_characters_are_shown_and_long_strings_cut() -> None:
    profile = _profile({"login": "octo\ncat\u202e", "name": "x" * (NAME_LIMIT + 50)})

    assert profile["login"] == "octo cat[U+202E]"
    assert isinstance(profile["name"], str) and len(profile["name"]) <= NAME_LIMIT


def test_values_of_another_type_become_none() -> None:
    profile = _profile({"login": {"nested": "object"}, "id": True, "name": ["a", "b"]})

    assert profile == {"login": None, "id": None, "name": None}
