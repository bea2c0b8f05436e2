"""The failure every `connect-broker` command may expect (a database that does not answer, a busy
port): `app.cli` prints its message as one line and exits 1, without a traceback."""

from __future__ import annotations


class CommandFailed(Exception):
    """An expected failure of a command; the message says what happened and what to do."""
