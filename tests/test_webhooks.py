"""Lifecycle events are posted to the configured webhooks: signed, in order, at least once, once
across replicas, retried with backoff for 24 hours, then given up (app/webhooks/).

The events come from the session broker (a connect round driven as users drive it) or are
recorded here with `app.audit` in transactions of their own; they are delivered by a broker
process serving the same database with `[webhooks.<name>]` configured, or by the delivery loop's
own step (`Webhooks.run_once`) run in this process on the broker's database and configuration,
with the clock moved past the retry delays (time-machine), as the revocation tests do. Every
receiver is a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from app import audit
from app.auth.principal import Principal
from app.clock import utcnow
from app.config import ConfigError, load_settings
from app.main import Shared, build_shared
from app.mcp.registry import ToolRegistry
from app.models import WebhookDelivery
from app.tables import audit as audit_table
from app.webhooks import delivery
from app.webhooks.settings import EVENTS

from .oauth.flows import connect, tool_result
from .oauth.helpers import unique as fresh_user
from .oauth.test_refresh_revoke import ask_to_disconnect, confirm_disconnect
from .oauth.test_revocation_retries import close_runtime, later
from .support.broker import BrokerProcess, cli, database_kind, serve_replica
from .support.clients import Browser, McpHttp
from .support.http import local_client
from .support.webhook_receiver import Delivery, Receiver, running_receiver

pytestmark = pytest.mark.both_databases

ROOT = Path(__file__).resolve().parent.parent
SECRET = f"whsec-CANARY-{secrets.token_hex(16)}"
METRICS_TOKEN = "m" * 40
ISSUER = "https://idp.webhooks.test"
ROUND = ["flow.created", "flow.completed", "credential.stored", "connection.disconnected"]
only_postgresql = pytest.mark.skipif(
    database_kind() != "postgresql", reason="transactions commit out of id order on PostgreSQL"
)


def documented_verify() -> Callable[[str, dict[str, str], bytes], bool]:
    """The `verify` function of docs/webhooks.md, run as written there."""
    text = (ROOT / "docs" / "webhooks.md").read_text()
    blocks = [
        block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "def verify" in block
    ]
    assert len(blocks) == 1
    namespace: dict[str, Any] = {}
    # the documentation's own code, from this repository: what a receiver would paste
    exec(compile(blocks[0], "docs/webhooks.md", "exec"), namespace)  # noqa: S102
    verify: Callable[[str, dict[str, str], bytes], bool] = namespace["verify"]
    return verify


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("webhooks") / "secret"
    path.write_text(SECRET + "\n")
    return path


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with running_receiver() as running:
        yield running


def webhook(url: str, secret_file: Path, events: list[str] | None = None) -> dict[str, Any]:
    return {"url": url, "secret_file": str(secret_file), "events": events or ["*"]}


def with_metrics(broker: BrokerProcess) -> dict[str, dict[str, Any]]:
    extra = dict(broker.config.extra)
    extra["server"] = {**extra.get("server", {}), "metrics_token": METRICS_TOKEN}
    return extra


@pytest.fixture(scope="module")
def webhook_replica(
    broker: BrokerProcess, receiver: Receiver, secret_file: Path
) -> Iterator[BrokerProcess]:
    """A second process on the session broker's database, posting every event to `receiver`."""
    replica = serve_replica(
        broker,
        name="webhooks",
        webhooks={"ops": webhook(receiver.url, secret_file)},
        extra=with_metrics(broker),
    )
    try:
        yield replica
    finally:
        replica.stop()


def of_user(user: str) -> Callable[[dict[str, Any]], bool]:
    return lambda event: event["subject"] == user


async def scrape(broker: BrokerProcess) -> str:
    async with local_client(timeout=10) as http:
        response = await http.get(
            f"{broker.url}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
        )
    assert response.status_code == 200
    return response.text


async def test_a_connect_and_disconnect_round_is_posted_signed_and_in_order(
    webhook_replica: BrokerProcess,
    receiver: Receiver,
    mcp: McpHttp,
    token_for: Any,
    browser: Browser,
) -> None:
    user = fresh_user("webhook-round")
    token = token_for(user)
    await connect(mcp, browser, token, user)
    asked = await ask_to_disconnect(mcp, token)
    tool_result(await confirm_disconnect(mcp, token, asked))

    posted = await receiver.wait_for(len(ROUND) + 1, of_user(user))
    verify = documented_verify()

    assert [d.event["event"] for d in posted] == [*ROUND, "revocation.confirmed"]
    ids = [d.event["id"] for d in posted]
    assert ids == sorted(ids)
    for d in posted:
        assert verify(SECRET, d.headers, d.body)
        assert d.headers["x-connect-broker-event-id"] == str(d.event["id"])
        assert d.headers["x-connect-broker-event"] == d.event["event"]
        assert d.headers["content-type"] == "application/json"
    first = posted[0]
    assert not verify("another-secret-of-32-characters!", first.headers, first.body)
    assert not verify(SECRET, first.headers, first.body.replace(b"flow.created", b"flow.expired"))
    stale = {**first.headers, "x-connect-broker-timestamp": "1000000000"}
    assert not verify(SECRET, stale, first.body)
    assert set(first.event) == {
        "id",
        "event",
        "occurred_at",
        "actor",
        "issuer",
        "subject",
        "provider",
        "audience",
        "account_label",
        "detail",
        "request_id",
    }
    assert first.event["actor"] == {"kind": "user", "id": f"{first.event['issuer']}|{user}"}
    assert (first.event["provider"], first.event["audience"]) == ("github", "mcp")
    assert posted[2].event["account_label"] == "@octocat"
    assert first.event["occurred_at"].endswith("Z")
    assert SECRET not in webhook_replica.log()


async def test_the_metrics_count_deliveries_and_show_the_backlog(
    webhook_replica: BrokerProcess, receiver: Receiver, mcp: McpHttp, token_for: Any
) -> None:
    user = fresh_user("webhook-metrics")
    await mcp.call_tool(token_for(user), "connect_account", {"provider": "github"})
    await receiver.wait_for(1, of_user(user))

    text = await scrape(webhook_replica)

    assert re.search(r'broker_webhook_deliveries_total\{outcome="ok",webhook="ops"\} [1-9]', text)
    assert re.search(r'broker_webhook_backlog\{webhook="ops"\} \d', text)
    assert "broker_webhook_abandoned_total" in text


def test_check_config_lists_the_webhooks_without_the_query(
    webhook_replica: BrokerProcess,
) -> None:
    result = cli("check-config", config_path=webhook_replica.config_path)

    assert result.returncode == 0, result.stderr
    assert "1 webhook(s)" in result.stdout
    assert "webhook ops: * to http://127.0.0.1:" in result.stdout
    assert "team=ops" not in result.stdout
    assert SECRET not in result.stdout + result.stderr


# The delivery loop's step, run in this process


@contextlib.asynccontextmanager
async def delivering(
    broker: BrokerProcess,
    url: str,
    secret_file: Path,
    events: list[str] | None = None,
    *,
    name: str | None = None,
) -> AsyncIterator[tuple[str, Shared]]:
    """A webhook of its own (a fresh name unless `name`) on the broker's database, its row
    started."""
    name = name or f"t-{secrets.token_hex(4)}"
    overrides = {
        f"webhooks.{name}.{key}": value for key, value in webhook(url, secret_file, events).items()
    }
    runtime = build_shared(load_settings(broker.config_path, overrides=overrides), ToolRegistry())
    try:
        await runtime.webhooks.start()
        yield name, runtime
    finally:
        await close_runtime(runtime)


async def record(
    runtime: Shared, user: str, detail: str, event: str = "service.created", *, wait: bool = True
) -> None:
    """One event about `user`, in a transaction of its own; with `wait`, returns once it is
    settled."""
    async with runtime.sessionmaker.begin() as session:
        await audit.record(
            session, event, actor=audit.CLI, principal=Principal(ISSUER, user), detail=detail
        )
    if wait:
        await settled(runtime)


SETTLED = text(
    "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint > max(txid) FROM audit_events"
)


async def settled(runtime: Shared) -> None:
    """PostgreSQL: wait until no running transaction is older than the events written so far.
    A transaction of any database on the server counts (the snapshot is the server's): with
    other tests busy on it, an event may need a moment before a webhook may post it."""
    if database_kind() != "postgresql":
        return
    deadline = time.monotonic() + 10
    while True:
        async with runtime.sessionmaker() as session:
            if await session.scalar(SETTLED):
                return
        assert time.monotonic() < deadline, "a transaction on the server stayed open for 10 s"
        await asyncio.sleep(0.05)


async def state_of(runtime: Shared, name: str) -> WebhookDelivery:
    async with runtime.sessionmaker() as session:
        row = await session.scalar(select(WebhookDelivery).where(WebhookDelivery.webhook == name))
    assert row is not None
    return row


def details(posted: list[Delivery]) -> list[str]:
    return [d.event["detail"] for d in posted]


async def test_a_backlog_waits_for_a_receiver_that_is_down_and_then_arrives_in_order(
    broker: BrokerProcess, secret_file: Path
) -> None:
    user = fresh_user("webhook-down")
    down = Receiver()  # not started: the connection is refused
    async with delivering(broker, down.url, secret_file) as (name, runtime):
        for n in range(3):
            await record(runtime, user, f"n={n}")
        refused = await runtime.webhooks.run_once()
        first = await state_of(runtime, name)
        with later(delivery.FIRST_RETRY_SECONDS + 1):
            refused_again = await runtime.webhooks.run_once()
            second = await state_of(runtime, name)
        down.start()
        try:
            with later(delivery.FIRST_RETRY_SECONDS + 5):
                too_early = await runtime.webhooks.run_once()
            with later(delivery.FIRST_RETRY_SECONDS * 3 + 2):
                delivered = await runtime.webhooks.run_once()
                after = await state_of(runtime, name)
        finally:
            down.stop()
        metrics = runtime.metrics.render(None).decode()

    assert (refused, refused_again, too_early) == (0, 0, 0)
    assert (first.attempts, first.last_error) == (1, "ConnectError")
    assert first.next_attempt_at - utcnow() > timedelta(seconds=delivery.FIRST_RETRY_SECONDS - 2)
    assert second.attempts == 2
    assert second.next_attempt_at - first.next_attempt_at > timedelta(
        seconds=delivery.FIRST_RETRY_SECONDS * 2 - 2
    )  # doubled
    assert delivered == 3
    assert details(down.events(of_user(user))) == ["n=0", "n=1", "n=2"]
    assert (after.attempts, after.head_id, after.last_error) == (0, None, None)
    assert f'broker_webhook_deliveries_total{{outcome="failed",webhook="{name}"}} 2.0' in metrics
    assert f'broker_webhook_deliveries_total{{outcome="ok",webhook="{name}"}} 3.0' in metrics


async def test_an_event_failing_for_24_hours_is_given_up_and_the_next_one_delivered(
    broker: BrokerProcess, secret_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    user = fresh_user("webhook-abandon")
    failing = Receiver(status=503)
    failing.start()
    try:
        async with delivering(broker, failing.url, secret_file) as (name, runtime):
            await record(runtime, user, "n=0")
            await runtime.webhooks.run_once()
            almost = delivery.GIVE_UP_AFTER - timedelta(seconds=5)
            with later(almost.total_seconds()):
                await runtime.webhooks.run_once()  # the last post: its retry would be too late
                given_up = await state_of(runtime, name)
                await record(runtime, user, "n=1")
                failing.status = 204
                delivered = await runtime.webhooks.run_once()
            metrics = runtime.metrics.render(None).decode()
    finally:
        failing.stop()

    assert delivered == 1
    assert details(failing.events(of_user(user))) == ["n=1"]
    assert given_up.attempts == 0  # the cursor moved past it
    assert f'broker_webhook_abandoned_total{{webhook="{name}"}} 1.0' in metrics
    assert f'broker_webhook_deliveries_total{{outcome="failed",webhook="{name}"}} 2.0' in metrics
    abandoned = [r.getMessage() for r in caplog.records if "webhook.abandoned" in r.getMessage()]
    assert len(abandoned) == 1
    assert f"webhook={name} " in abandoned[0] and "error=http_503" in abandoned[0]
    failed = [r.getMessage() for r in caplog.records if "webhook.delivery_failed" in r.getMessage()]
    assert failed and all("127.0.0.1" not in line and SECRET not in line for line in failed)


async def test_events_older_than_24_hours_are_given_up_without_a_post_in_one_line(
    broker: BrokerProcess, secret_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After an outage longer than a day, the events past their 24 hours are given up at once,
    counted each, logged as one run; the first event still within its time is posted."""
    user = fresh_user("webhook-expired")
    with running_receiver() as listening:
        async with delivering(broker, listening.url, secret_file) as (name, runtime):
            for n in range(3):
                await record(runtime, user, f"n={n}")
            with later(delivery.GIVE_UP_AFTER.total_seconds() + 60):
                await record(runtime, user, "fresh")
                delivered = await runtime.webhooks.run_once()
            metrics = runtime.metrics.render(None).decode()

    assert delivered == 1
    assert details(listening.events(of_user(user))) == ["fresh"]
    assert f'broker_webhook_abandoned_total{{webhook="{name}"}} 3.0' in metrics
    abandoned = [r.getMessage() for r in caplog.records if "webhook.abandoned" in r.getMessage()]
    assert len(abandoned) == 1
    assert "count=3" in abandoned[0] and "error=expired" in abandoned[0]


async def test_a_redirect_is_a_failure_and_is_not_followed(
    broker: BrokerProcess, secret_file: Path
) -> None:
    user = fresh_user("webhook-redirect")
    with running_receiver() as redirecting:
        redirecting.status = 302
        async with delivering(broker, redirecting.url, secret_file) as (name, runtime):
            await record(runtime, user, "n=0")
            await runtime.webhooks.run_once()
            state = await state_of(runtime, name)

    assert (state.attempts, state.last_error) == (1, "http_302")
    assert redirecting.requests == 1


@pytest.mark.slow
async def test_a_receiver_that_does_not_answer_is_given_up_on_after_5_seconds(
    broker: BrokerProcess, secret_file: Path
) -> None:
    user = fresh_user("webhook-silent")
    with running_receiver() as silent:
        silent.delay = delivery.TIMEOUT_SECONDS + 3
        async with delivering(broker, silent.url, secret_file) as (name, runtime):
            await record(runtime, user, "n=0")
            started = time.monotonic()
            await runtime.webhooks.run_once()
            took = time.monotonic() - started
            state = await state_of(runtime, name)

    assert state.attempts == 1
    assert state.last_error in ("ReadTimeout", "TimeoutError")
    assert took < delivery.TIMEOUT_SECONDS + 1.5


async def test_a_webhook_gets_only_its_events_and_starts_from_when_it_is_first_served(
    broker: BrokerProcess, secret_file: Path
) -> None:
    user = fresh_user("webhook-filter")
    with running_receiver() as listening:
        async with delivering(broker, listening.url, secret_file, ["user.erased"]) as (_, runtime):
            await record(runtime, user, "before", event="user.erased")
        async with delivering(broker, listening.url, secret_file, ["user.erased"]) as (_, runtime):
            await record(runtime, user, "skipped", event="service.created")
            await record(runtime, user, "wanted", event="user.erased")
            delivered = await runtime.webhooks.run_once()

    assert delivered == 1
    assert details(listening.events(of_user(user))) == ["wanted"]


async def test_a_webhook_added_back_under_its_name_resumes_with_the_events_meanwhile(
    broker: BrokerProcess, secret_file: Path
) -> None:
    """docs/webhooks.md: a webhook's place is kept under its name while it is not configured."""
    user, name = fresh_user("webhook-resume"), f"t-{secrets.token_hex(4)}"
    erased = ["user.erased"]
    with running_receiver() as listening:
        async with delivering(broker, listening.url, secret_file, erased, name=name) as (_, first):
            await record(first, user, "served", event="user.erased")
            assert await first.webhooks.run_once() == 1
        async with delivering(broker, listening.url, secret_file, ["service.created"]) as (
            _,
            other,
        ):
            await record(other, user, "meanwhile", event="user.erased")  # not configured: kept
        async with delivering(broker, listening.url, secret_file, erased, name=name) as (_, again):
            delivered = await again.webhooks.run_once()

    assert delivered == 1
    assert details(listening.events(of_user(user))) == ["served", "meanwhile"]


async def test_an_erasure_of_the_failing_event_lets_the_next_one_through(
    broker: BrokerProcess, secret_file: Path
) -> None:
    """Deleted events (erasure, retention) leave nothing behind in the delivery state: the
    attempts counted for a deleted head event are not the next event's."""
    erased, kept = fresh_user("webhook-erased"), fresh_user("webhook-kept")
    down = Receiver()
    async with delivering(broker, down.url, secret_file) as (name, runtime):
        await record(runtime, erased, "gone")
        await record(runtime, kept, "kept")
        await runtime.webhooks.run_once()
        async with runtime.sessionmaker.begin() as session:
            await session.execute(
                audit_table.remove_of_user(ISSUER, erased, utcnow() + timedelta(days=1))
            )
        down.start()
        try:
            with later(delivery.FIRST_RETRY_SECONDS + 1):
                delivered = await runtime.webhooks.run_once()
        finally:
            down.stop()
        state = await state_of(runtime, name)

    assert delivered == 1
    assert details(down.events(lambda e: e["subject"] in (erased, kept))) == ["kept"]
    assert state.attempts == 0


@only_postgresql
async def test_an_event_committed_after_a_later_one_is_not_skipped(
    broker: BrokerProcess, secret_file: Path
) -> None:
    """The first transaction takes the smaller id but commits last: the later event waits for
    it (a cursor on ids alone would have passed the first event before it was visible)."""
    user = fresh_user("webhook-gap")
    with running_receiver() as listening:
        async with delivering(broker, listening.url, secret_file) as (_, runtime):
            async with runtime.engine.connect() as slow:
                transaction = await slow.begin()
                row = audit.row(
                    "service.created", actor=audit.CLI, principal=Principal(ISSUER, user)
                )
                await slow.execute(audit_table.add([{**row, "detail": "first"}]))
                await record(runtime, user, "second", wait=False)  # it waits for "first"
                while_open = await runtime.webhooks.run_once()
                await transaction.commit()
            await settled(runtime)
            delivered = await runtime.webhooks.run_once()

    assert while_open == 0
    assert delivered == 2
    assert details(listening.events(of_user(user))) == ["first", "second"]


@only_postgresql
async def test_two_replicas_post_each_event_once_and_in_order(
    broker: BrokerProcess, secret_file: Path
) -> None:
    user = fresh_user("webhook-pair")
    with running_receiver() as listening:
        hooks = {"pair": webhook(listening.url, secret_file, ["service.created"])}
        first = serve_replica(broker, name="pair-1", webhooks=hooks)
        second = serve_replica(broker, name="pair-2", webhooks=hooks)
        try:
            runtime = build_shared(load_settings(broker.config_path), ToolRegistry())
            try:
                for n in range(30):
                    await record(runtime, user, f"n={n}")
            finally:
                await close_runtime(runtime)
            posted = await listening.wait_for(30, of_user(user))
            again = await listening.wait_for(31, of_user(user))  # waits, for a duplicate
        finally:
            first.stop()
            second.stop()

    assert details(posted) == [f"n={n}" for n in range(30)]
    assert len(again) == 30
    ids = [d.event["id"] for d in posted]
    assert len(set(ids)) == 30


# Configuration


def test_every_audit_event_of_the_operations_guide_can_be_chosen() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Audit events", 1)[1].split("\n## ", 1)[0]
    documented = set(
        re.findall(r"^\| `([a-z_]+\.[a-z_]+)`(?:, `([a-z_]+\.[a-z_]+)`)? \|", section, re.M)
    )
    names = {name for pair in documented for name in pair if name}
    assert names == EVENTS


def write_config(tmp_path: Path, webhook_table: str, extra: str = "") -> Path:
    path = tmp_path / "broker.toml"
    path.write_text(extra + "[webhooks.ops]\n" + webhook_table)
    return path


@pytest.fixture
def good_secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    return path


def test_a_webhook_reads_its_secret_from_its_file(tmp_path: Path, good_secret: Path) -> None:
    path = write_config(
        tmp_path, f'url = "https://hooks.example.com/x"\nsecret_file = "{good_secret}"\n'
    )
    settings = load_settings(
        path, environ={"BROKER_WEBHOOKS_OPS_EVENTS": "user.erased,flow.created"}
    )

    hook = settings.webhooks["ops"]
    assert hook.secret.get_secret_value() == SECRET
    assert hook.events == ("user.erased", "flow.created")
    assert SECRET not in repr(settings)


@pytest.mark.parametrize(
    ("table", "key", "message"),
    [
        (
            'url = "https://h.example/x"\nsecret_file = "{missing}"\n',
            "webhooks.ops.secret_file",
            "cannot read",
        ),
        (
            'url = "https://h.example/x"\nsecret_file = "{empty}"\n',
            "webhooks.ops.secret_file",
            "is empty",
        ),
        (
            'url = "https://h.example/x"\nsecret_file = "{short}"\n',
            "webhooks.ops.secret_file",
            "at least 16",
        ),
        ('url = "https://h.example/x"\n', "webhooks.ops.secret_file", "Field required"),
        (
            'url = "https://h.example/x"\nsecret = "inline-CANARY-value"\nsecret_file = "{good}"\n',
            "webhooks.ops.secret",
            "did you mean 'secret_file'",
        ),
        ('url = "ftp://h.example/x"\nsecret_file = "{good}"\n', "webhooks.ops.url", "http(s)"),
        (
            'url = "https://user:pw@h.example/x"\nsecret_file = "{good}"\n',
            "webhooks.ops.url",
            "user info",
        ),
        (
            'url = "https://h.example/x"\nsecret_file = "{good}"\nevents = ["flow.exploded"]\n',
            "webhooks.ops.events",
            "unknown event 'flow.exploded'",
        ),
        (
            'url = "https://h.example/x"\nsecret_file = "{good}"\nevents = ["*", "flow.created"]\n',
            "webhooks.ops.events",
            "every event",
        ),
        (
            'url = "https://h.example/x"\nsecret_file = "{good}"\nevents = []\n',
            "webhooks.ops.events",
            "at least one",
        ),
    ],
)
def test_a_bad_webhook_is_refused_naming_its_key(
    tmp_path: Path, good_secret: Path, table: str, key: str, message: str
) -> None:
    files = {
        "missing": tmp_path / "absent",
        "empty": tmp_path / "empty",
        "short": tmp_path / "short",
    }
    files["empty"].write_text("\n")
    files["short"].write_text("too-short")
    path = write_config(tmp_path, table.format(good=good_secret, **files))

    with pytest.raises(ConfigError) as refused:
        load_settings(path, environ={})

    assert str(refused.value).startswith(f"{key}: ")
    assert message in str(refused.value)
    assert "CANARY" not in str(refused.value)


def test_webhooks_need_the_audit_events_kept_two_days(tmp_path: Path, good_secret: Path) -> None:
    path = write_config(
        tmp_path,
        f'url = "https://h.example/x"\nsecret_file = "{good_secret}"\n',
        extra="[audit]\nretention_days = 1\n",
    )

    with pytest.raises(
        ConfigError, match=r"^audit.retention_days: must be at least 2 with webhooks"
    ):
        load_settings(path, environ={})


def test_a_webhook_name_is_checked_like_a_provider_s(tmp_path: Path, good_secret: Path) -> None:
    path = tmp_path / "broker.toml"
    path.write_text(f'[webhooks.Ops]\nurl = "https://h.example/x"\nsecret_file = "{good_secret}"\n')

    with pytest.raises(ConfigError, match=r"^webhooks.Ops: names are lowercase"):
        load_settings(path, environ={})
