"""`redacted_traceback` writes what the standard library writes for an exception chain, except
that every exception's message is withheld."""

from __future__ import annotations

import re
import traceback

import pytest

from app.bug_report import WITHHELD, redacted_traceback

SECRETS = ("sk_CANARY_cause", "sk_CANARY_context", "sk_CANARY_final")


class StoreError(Exception):
    pass


def _read(key: str) -> str:
    raise KeyError(key)


def _chain() -> BaseException:
    """KeyError -> (context) ValueError -> (cause) StoreError, each message holding a secret."""
    try:
        try:
            _read(SECRETS[0])
        except KeyError:
            raise ValueError(f"bad value {SECRETS[1]}")  # noqa: B904 - the implicit context
    except ValueError as context:
        try:
            raise StoreError(f"could not store {SECRETS[2]}") from context
        except StoreError as final:
            return final
    raise AssertionError("unreachable")


def _standard_with_messages_withheld(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc)).rstrip("\n")
    # the exception lines are the ones a frame's indentation does not start
    return re.sub(
        r"(?m)^((?:[\w.]+\.)?(?:KeyError|ValueError|StoreError)): .*$", rf"\1: {WITHHELD}", text
    )


def test_the_chain_reads_as_the_standard_traceback_with_messages_withheld() -> None:
    exc = _chain()
    text = redacted_traceback(exc)

    assert text == _standard_with_messages_withheld(exc)
    assert "During handling of the above exception" in text
    assert "The above exception was the direct cause" in text
    assert text.index("KeyError:") < text.index("ValueError:") < text.index(".StoreError:")
    for secret in SECRETS:
        assert secret not in text


def _suppressed() -> BaseException:
    try:
        try:
            _read(SECRETS[0])
        except KeyError:
            raise StoreError(SECRETS[2]) from None
    except StoreError as exc:
        return exc
    raise AssertionError("unreachable")


def test_a_suppressed_context_is_left_out_as_the_standard_text_leaves_it() -> None:
    exc = _suppressed()
    text = redacted_traceback(exc)
    assert text == _standard_with_messages_withheld(exc)
    assert "KeyError" not in text and SECRETS[0] not in text


def test_a_cycle_in_the_chain_ends_the_walk() -> None:
    first, second = ValueError(SECRETS[0]), ValueError(SECRETS[1])
    first.__context__, second.__context__ = second, first
    text = redacted_traceback(first)
    assert text.count("ValueError") == 2
    assert SECRETS[0] not in text and SECRETS[1] not in text


@pytest.mark.parametrize("exc", [KeyError(SECRETS[0]), StoreError(SECRETS[2])])
def test_an_exception_never_raised_is_its_type_alone(exc: BaseException) -> None:
    assert redacted_traceback(exc) == _standard_with_messages_withheld(exc)


def _fail(secret: str) -> None:
    raise ValueError(secret)


def _group() -> BaseException:
    """A group of: a ValueError, a StoreError caused by a KeyError, and a group of a TypeError;
    wrapped in a RuntimeError. Every message holds a secret."""
    members: list[Exception] = []
    try:
        _fail(SECRETS[0])
    except ValueError as exc:
        members.append(exc)
    try:
        try:
            _read(SECRETS[1])
        except KeyError as cause:
            raise StoreError(SECRETS[2]) from cause
    except StoreError as exc:
        members.append(exc)
    members.append(ExceptionGroup(f"inner {SECRETS[0]}", [TypeError(SECRETS[1])]))
    try:
        try:
            raise ExceptionGroup(f"outer {SECRETS[2]}", members)
        except ExceptionGroup as group:
            raise RuntimeError(SECRETS[0]) from group
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def test_an_exception_group_lists_each_member_with_its_own_chain() -> None:
    text = redacted_traceback(_group())
    lines = text.splitlines()

    for secret in SECRETS:
        assert secret not in text
    exception_lines = [line for line in lines if line.endswith(f": {WITHHELD}")]
    assert [line.split(":")[0].strip(" |") for line in exception_lines] == [
        "ExceptionGroup",
        "ValueError",
        "KeyError",
        "tests.test_bug_report.StoreError",
        "ExceptionGroup",
        "TypeError",
        "RuntimeError",
    ]
    assert "  +---------------- 1 of 3 ----------------" in lines
    assert "  |   +---------------- 1 of 1 ----------------" in lines
    assert any(line.startswith("  |   File ") and line.endswith("in _fail") for line in lines)
    assert "  | The above exception was the direct cause of the following exception:" in lines
    assert lines[-1] == f"RuntimeError: {WITHHELD}"
    assert all(line == line.rstrip() for line in lines)
