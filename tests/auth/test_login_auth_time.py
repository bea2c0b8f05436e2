"""The IdP's `auth_time` at the end of a sign-in.

The broker asks the IdP for a fresh authentication (`max_age`, D12). An IdP that ignores it and
answers with an older sign-in would make a session that never counts: the connect page would
send the browser to sign in again, and the IdP would answer the same way, without end. The
callback says so on a page instead. The real IdP of the other tests honours `max_age`, so this
rule is checked on its own here.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from app.clock import utcnow
from app.errors import BadLogin
from app.pages.login import login_auth_time

MAX_AGE = 3600


def test_a_recent_authentication_is_the_session_s_time() -> None:
    recent = utcnow() - timedelta(seconds=30)

    assert login_auth_time({"auth_time": int(recent.timestamp())}, MAX_AGE) == recent.replace(
        microsecond=0
    )


def test_an_authentication_older_than_the_maximum_age_is_refused_with_what_to_do() -> None:
    old = utcnow() - timedelta(seconds=MAX_AGE + 5)

    with pytest.raises(BadLogin) as refused:
        login_auth_time({"auth_time": old.timestamp()}, MAX_AGE)

    assert "older than this service accepts" in refused.value.public_message
    assert "Sign out at your identity provider" in refused.value.public_next_step


@pytest.mark.parametrize("value", [None, "yesterday", True])
def test_without_a_usable_auth_time_the_sign_in_counts_from_now(value: object) -> None:
    claims = {} if value is None else {"auth_time": value}

    assert abs(login_auth_time(claims, MAX_AGE) - utcnow()) < timedelta(seconds=5)


@pytest.mark.parametrize("value", [1e20, float("nan"), -1e20])
def test_an_auth_time_that_is_no_time_is_a_failed_sign_in(value: float) -> None:
    with pytest.raises(BadLogin):
        login_auth_time({"auth_time": value}, MAX_AGE)


def test_an_auth_time_in_the_future_counts_from_now() -> None:
    ahead = utcnow() + timedelta(minutes=5)

    assert login_auth_time({"auth_time": ahead.timestamp()}, MAX_AGE) <= utcnow()
