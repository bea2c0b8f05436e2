"""Every statement on `service_clients`.

The hot reads (`find_one`, `find_with_connection_one`/`_many`) take the secret's digests under
every configured key: a list the direct store expands to one parameter per key.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Insert,
    Select,
    Text,
    Update,
    bindparam,
    func,
    insert,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from app.models import ServiceClient
from app.tables import Rows, inline
from app.tables.connections import with_connection

HOT_COLUMNS = (ServiceClient.name, ServiceClient.providers)
USER = ("issuer", "subject", "provider")


def _live(digest_matches: ColumnElement[bool]) -> Rows:
    """The unrevoked service whose secret digest matches."""
    return (
        select(*HOT_COLUMNS)
        .where(digest_matches, ServiceClient.revoked_at.is_(None))
        .limit(inline(1))
    )


def _digests() -> ColumnElement[bool]:
    return ServiceClient.secret_digest.in_(bindparam("digests", type_=Text, expanding=True))


def find_one() -> Rows:
    """The service holding one of the bound `digests`."""
    return _live(_digests())


def find_with_connection_one() -> Rows:
    """`find_one`, with the connection that service made for the bound (issuer, subject,
    provider)."""
    user = [bindparam(name, type_=Text) for name in USER]
    issuer, subject, provider = user
    return with_connection(
        _live(_digests()),
        issuer,
        subject,
        provider,
        ServiceClient.name,
        lateral=False,
        present=ServiceClient.id,
    )


def find_with_connection_many() -> Rows:
    """`find_with_connection_one` for arrays of users (one per call, position `n` from 1); each
    call's digests are in the array `digests`, with the call's position in `digest_call`."""
    users = [bindparam(name, type_=ARRAY(Text)) for name in USER]
    calls = func.unnest(*users).table_valued(*USER, with_ordinality="n").render_derived(name="k")
    digests = (
        func.unnest(
            bindparam("digest_call", type_=ARRAY(BigInteger)),
            bindparam("digests", type_=ARRAY(Text)),
        )
        .table_valued("n", "digest")
        .render_derived(name="d")
    )
    of_call = select(digests.c.digest).where(digests.c.n == calls.c.n).correlate(calls)
    service = _live(ServiceClient.secret_digest.in_(of_call)).lateral("s")
    found = select(calls.c.n, service.c.name, service.c.providers).select_from(
        calls.join(service, true())
    )
    issuer, subject, provider = (calls.c[name] for name in USER)
    return with_connection(found, issuer, subject, provider, service.c.name, lateral=True)


def add(name: str, secret_digest: str, providers: str, now: datetime) -> Insert:
    return insert(ServiceClient).values(
        name=name, secret_digest=secret_digest, providers=providers, created_at=now
    )


def by_name() -> Select[ServiceClient]:
    return select(ServiceClient).order_by(ServiceClient.name)


def revoke(name: str, now: datetime) -> Update:
    return (
        update(ServiceClient)
        .where(ServiceClient.name == name, ServiceClient.revoked_at.is_(None))
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    )
