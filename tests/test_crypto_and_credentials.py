"""Sealing (AES-GCM bound to its owner), the credential store, and key rotation."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import ColumnElement, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app import credentials
from app.auth.principal import McpCaller, Principal
from app.connect import revocations
from app.connect.request_state import RequestStateCodec, StateRejected
from app.crypto import (
    InvalidSeal,
    Keyring,
    b64decode,
    b64encode,
    generate_key,
    random_token,
    seal,
    unseal,
)
from app.db import create_engine, create_sessionmaker
from app.migrate import upgrade
from app.models import Connection, PendingRevocation

from .support.broker import drop_database, fresh_database

pytestmark = pytest.mark.both_databases

ALICE = Principal("https://idp.example", "alice")
BOB = Principal("https://idp.example", "bob")


def _decoded(decode: Callable[[str], bytes], text: str) -> bytes | None:
    """The decoded bytes, or None for a ValueError (binascii.Error and UnicodeEncodeError are
    both ValueErrors, which is what callers catch)."""
    try:
        return decode(text)
    except ValueError:
        return None


@pytest.mark.parametrize(
    "text",
    ["", "QQ", "QUI", "QUJD", "-_-_", "a-b_c", "QU JD", "Q!U*J", "QUJD" * 100, "Q", "QUJDQ", "é"],
)
def test_b64decode_decodes_and_refuses_as_the_standard_library_does(text: str) -> None:
    """Unpadded base64url; characters outside the alphabet skipped, impossible lengths and
    non-ASCII text refused (a ValueError), as `urlsafe_b64decode` does."""

    def standard(value: str) -> bytes:
        return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))

    assert _decoded(b64decode, text) == _decoded(standard, text)


def test_b64decode_reverses_b64encode() -> None:
    for size in range(70):
        data = os.urandom(size)
        assert b64decode(b64encode(data)) == data


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    url = await asyncio.to_thread(fresh_database, tmp_path, "crypto")
    await asyncio.to_thread(upgrade, url)  # both run their own event loop
    engine = create_engine(url, pool_size=2)
    yield create_sessionmaker(engine)
    await engine.dispose()
    await asyncio.to_thread(drop_database, url)


async def read_credential(
    session: AsyncSession, *, keys: Keyring, principal: Principal, provider: str, audience: str
) -> str | None:
    """The stored secret as the broker reads it, or None when no configured key opens it."""
    row = await credentials.find(session, principal=principal, provider=provider, audience=audience)
    secret = credentials.open_row(row, keys=keys) if row is not None else None
    return credentials.as_credential(row, secret).secret if row and secret else None


async def copy_sealed(
    session: AsyncSession, source: ColumnElement[bool], target: ColumnElement[bool]
) -> None:
    """Copy one connection's ciphertext into another row, as someone with write access would."""
    sealed = (
        await session.execute(select(Connection.sealed_credential).where(source))
    ).scalar_one()
    await session.execute(update(Connection).where(target).values(sealed_credential=sealed))


def test_seal_round_trip_and_purpose_binding() -> None:
    keys = Keyring.parse((generate_key("k1"),))
    sealed = seal(b"gho_secret", purpose="cred:v1|iss|alice|github|mcp", keys=keys)

    assert unseal(sealed, purpose="cred:v1|iss|alice|github|mcp", keys=keys) == b"gho_secret"
    assert b"gho_secret" not in sealed.encode()
    with pytest.raises(InvalidSeal):
        unseal(sealed, purpose="cred:v1|iss|bob|github|mcp", keys=keys)
    with pytest.raises(InvalidSeal):
        unseal(
            sealed[:-2] + ("A" if sealed[-2] != "A" else "B") + sealed[-1], purpose="x", keys=keys
        )


def test_random_tokens_are_43_urlsafe_chars_and_unique() -> None:
    """T10: 256-bit identifiers, no duplicates in 10k draws."""
    tokens = {random_token() for _ in range(10_000)}

    assert len(tokens) == 10_000
    assert all(len(t) == 43 and t.replace("-", "").replace("_", "").isalnum() for t in tokens)


async def test_i4_a_credential_copied_to_another_users_row_does_not_open(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """I4/T14: AAD binds the ciphertext to (issuer, subject, provider, audience)."""
    keys = Keyring.parse((generate_key("k1"),))
    async with sessions.begin() as session:
        for principal, secret in ((ALICE, "sk_alice"), (BOB, "sk_bob")):
            await credentials.store(
                session,
                keys=keys,
                principal=principal,
                provider="demo",
                audience="mcp",
                secret={"api_key": secret},
            )
    async with sessions.begin() as session:
        await copy_sealed(session, Connection.subject == "alice", Connection.subject == "bob")

    async with sessions() as session:
        stolen = await read_credential(
            session, keys=keys, principal=BOB, provider="demo", audience="mcp"
        )
        own = await read_credential(
            session, keys=keys, principal=ALICE, provider="demo", audience="mcp"
        )

    assert stolen is None
    assert own == "sk_alice"


async def store_two_accounts(session: AsyncSession, keys: Keyring) -> None:
    """Alice's GitHub accounts @work (account id 1) and @home (account id 2)."""
    for account_id, token in (("1", "gho_work"), ("2", "gho_home")):
        await credentials.store(
            session,
            keys=keys,
            principal=ALICE,
            provider="github",
            audience="mcp",
            secret={"access_token": token},
            account_label=f"@{token[4:]}",
            account_id=account_id,
        )


async def accounts_of(
    session: AsyncSession, keys: Keyring, principal: Principal
) -> dict[str, str | None]:
    """Each of the principal's GitHub accounts: its secret as the broker reads it, or None."""
    held = await credentials.accounts(
        session, principal=principal, provider="github", audience="mcp"
    )
    opened = {name: credentials.open_row(row, keys=keys) for name, row in held.items()}
    return {name: (secret or {}).get("access_token") for name, secret in opened.items()}


async def test_i4_a_credential_copied_to_another_account_of_the_same_user_does_not_open(
    sessions: async_sessionmaker[AsyncSession], caplog: pytest.LogCaptureFixture
) -> None:
    """I4 with several accounts: the sealed text names the account it was sealed for, so
    swapping two accounts' ciphertexts (same user, provider, audience) opens neither."""
    keys = Keyring.parse((generate_key("k1"),))
    async with sessions.begin() as session:
        await store_two_accounts(session, keys)
    async with sessions() as session:
        before = await accounts_of(session, keys, ALICE)
    async with sessions.begin() as session:
        rows = await session.execute(select(Connection.account_id, Connection.sealed_credential))
        sealed = {row.account_id: row.sealed_credential for row in rows}
        for account_id, other in (("1", "2"), ("2", "1")):
            await session.execute(
                update(Connection)
                .where(Connection.account_id == account_id)
                .values(sealed_credential=sealed[other])
            )
    async with sessions() as session:
        swapped = await accounts_of(session, keys, ALICE)

    assert before == {"@work": "gho_work", "@home": "gho_home"}
    assert swapped == {"@work": None, "@home": None}
    assert caplog.text.count("credential.decrypt_failed provider=github") == 2
    assert "reason=account" in caplog.text


async def test_a_credential_sealed_before_the_account_was_bound_opens_and_rotation_binds_it(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """A ciphertext of an earlier version (no account inside) still opens; `keys rotate`
    re-seals it with the account, after which a copy to another account no longer opens."""
    old, new = generate_key("k1"), generate_key("k2")
    async with sessions.begin() as session:
        await store_two_accounts(session, Keyring.parse((old,)))
        unbound = seal(
            b'{"access_token": "gho_earlier"}',
            purpose=f"cred:v1|{ALICE.issuer}|{ALICE.subject}|github|mcp",
            keys=Keyring.parse((old,)),
        )
        await session.execute(
            update(Connection).where(Connection.account_id == "1").values(sealed_credential=unbound)
        )
    async with sessions() as session:
        earlier = await accounts_of(session, Keyring.parse((old,)), ALICE)
    async with sessions.begin() as session:
        await credentials.reseal_all(session, keys=Keyring.parse((new, old)))
    async with sessions.begin() as session:
        await copy_sealed(session, Connection.account_id == "1", Connection.account_id == "2")
    async with sessions() as session:
        after = await accounts_of(session, Keyring.parse((new,)), ALICE)

    assert earlier == {"@work": "gho_earlier", "@home": "gho_home"}
    assert after == {"@work": "gho_earlier", "@home": None}


async def test_i5_rotation_reseals_every_row_and_old_keys_can_then_go(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """I5/T28: new key first, old key kept until `keys rotate` re-sealed every row."""
    old, new = generate_key("k1"), generate_key("k2")
    async with sessions.begin() as session:
        for subject in ("a", "b", "c"):
            await credentials.store(
                session,
                keys=Keyring.parse((old,)),
                principal=Principal("iss", subject),
                provider="demo",
                audience="mcp",
                secret={"api_key": f"sk_{subject}"},
            )
    rotating = Keyring.parse((new, old))

    async with sessions.begin() as session:
        count = (await credentials.reseal_all(session, keys=rotating)).resealed
    async with sessions() as session:
        key_ids = set((await session.execute(select(Connection.key_id))).scalars())
        after = await read_credential(
            session,
            keys=Keyring.parse((new,)),
            principal=Principal("iss", "b"),
            provider="demo",
            audience="mcp",
        )

    assert count == 3
    assert key_ids == {"k2"}
    assert after == "sk_b"


async def test_i5_rotation_reseals_the_tokens_of_revocations_still_to_make(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    """A disconnect queues the grant's sealed tokens for revocation (app/connect/revocations.py):
    `keys rotate` re-seals them too, or dropping the old key would leave them unopenable."""
    old, new = generate_key("k1"), generate_key("k2")
    async with sessions.begin() as session:
        await credentials.store(
            session,
            keys=Keyring.parse((old,)),
            principal=Principal("iss", "leaving"),
            provider="github",
            audience="mcp",
            secret={"access_token": "gho_leaving"},
        )
    async with sessions.begin() as session:
        row = (
            await session.execute(select(Connection).where(Connection.subject == "leaving"))
        ).scalar_one()
        await revocations.queue(session, row)
        await session.delete(row)

    async with sessions.begin() as session:
        count = (await credentials.reseal_all(session, keys=Keyring.parse((new, old)))).resealed
    async with sessions() as session:
        queued = (await session.execute(select(PendingRevocation))).scalar_one()
        opened = credentials.open_row(queued, keys=Keyring.parse((new,)))

    assert count == 1
    assert queued.key_id == "k2"
    assert opened == {"access_token": "gho_leaving"}


def test_i5_request_state_signed_with_an_old_key_verifies_until_that_key_is_removed() -> None:
    old, new = generate_key("s1"), generate_key("s2")
    caller = McpCaller(ALICE, "client", frozenset())
    binding: dict[str, Any] = {"method": "tools/call", "name": "t", "arguments_digest": "d"}
    state = RequestStateCodec(Keyring.parse((old,)), max_age=60).issue(caller, **binding)

    still_valid = RequestStateCodec(Keyring.parse((new, old)), max_age=60).verify(
        state, caller, **binding
    )
    with pytest.raises(StateRejected) as refused:
        RequestStateCodec(Keyring.parse((new,)), max_age=60).verify(state, caller, **binding)
    assert refused.value.reason == "invalid"

    assert still_valid.flow_id is None


async def test_database_holds_no_plaintext_secret(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    keys = Keyring.parse((generate_key("k1"),))
    async with sessions.begin() as session:
        await credentials.store(
            session,
            keys=keys,
            principal=ALICE,
            provider="demo",
            audience="mcp",
            secret={"api_key": "sk_CANARYKEY_plaintext"},
        )
    async with sessions() as session:
        rows = (await session.execute(text("SELECT * FROM connections"))).all()

    assert rows and "CANARYKEY" not in repr(rows)


def configured_with_a_stored_key(
    tmp_path: Path, *, encryption: list[str], sealed_with: str, api_key: str
) -> tuple[str, Path]:
    """A migrated database holding one API key sealed with `sealed_with`, and a configuration
    file naming it with the `encryption` keys: (database URL, configuration path)."""
    from .support.broker import BrokerConfig

    url = fresh_database(tmp_path, "rotate")
    path = tmp_path / "broker.toml"
    path.write_text(BrokerConfig(issuer="http://127.0.0.1:1", encryption=encryption).render(url))
    upgrade(url)

    async def seed() -> None:
        engine = create_engine(url, pool_size=1)
        async with create_sessionmaker(engine).begin() as session:
            await credentials.store(
                session,
                keys=Keyring.parse((sealed_with,)),
                principal=ALICE,
                provider="demo",
                audience="mcp",
                secret={"api_key": api_key},
            )
        await engine.dispose()

    asyncio.run(seed())
    return url, path


def test_i5_keys_rotate_command_reseals_with_the_first_key(tmp_path: Path) -> None:
    """I5 through the CLI: put the new key first, keep the old one, run `keys rotate`."""
    from .support.broker import cli

    old, new = generate_key("e-old"), generate_key("e-new")
    url, path = configured_with_a_stored_key(
        tmp_path, encryption=[new, old], sealed_with=old, api_key="sk_x"
    )
    try:
        result = cli("keys", "rotate", config_path=path)
        again = cli("keys", "rotate", config_path=path)
    finally:
        drop_database(url)

    assert result.returncode == 0, result.stderr
    assert "re-sealed 1 credential(s) with key e-new" in result.stdout
    assert "re-sealed 0 credential(s)" in again.stdout


def test_keys_rotate_fails_while_a_credential_no_configured_key_opens_remains(
    tmp_path: Path,
) -> None:
    """The runbook's next step after `keys rotate` is removing the old key: a credential sealed
    with a key no longer configured must make the command fail and say so, not exit 0."""
    from .support.broker import cli

    lost, new = generate_key("e-lost"), generate_key("e-new")
    url, path = configured_with_a_stored_key(
        tmp_path, encryption=[new], sealed_with=lost, api_key="sk_lost"
    )
    try:
        result = cli("keys", "rotate", config_path=path)
    finally:
        drop_database(url)

    assert result.returncode == 1
    assert "re-sealed 0 credential(s) with key e-new" in result.stdout
    assert "1 credential(s) could not be opened with any configured key" in result.stderr
    assert "sk_lost" not in result.stdout + result.stderr
