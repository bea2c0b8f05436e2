"""GET /metrics: Prometheus text for a scrape with the configured token, counted by route
template (never by path), MCP outcome and security event; nothing secret or per-flow in it."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import delete, insert

from app.clock import utcnow
from app.db import create_engine
from app.metrics import BrokerMetrics, RevocationBacklog
from app.models import BROKER_AUDIENCE, PendingRevocation

from .conftest import DEMO_PROVIDER
from .connect import open_flow, submit_key, unique
from .support.broker import BrokerProcess
from .support.clients import CLIENT_LIMITS, Browser, McpHttp, request_body
from .support.http import local_client
from .support.schema import validate_response
from .support.stack import Stack, running_stack

SCRAPE_TOKEN = secrets.token_hex(32)
KEY = "sk_CANARYKEY_metrics_0001"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[Stack]:
    with running_stack(
        workdir,
        "metrics",
        providers={"demo": DEMO_PROVIDER},
        extra={"server": {"metrics_token": SCRAPE_TOKEN}},
    ) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[httpx2.AsyncClient]:
    async with local_client(timeout=30, limits=CLIENT_LIMITS) as client:
        yield client


async def scrape(http: httpx2.AsyncClient, broker: BrokerProcess) -> tuple[str, Samples]:
    response = await http.get(
        f"{broker.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return response.text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests(samples: Samples, route: str, method: str, status: str) -> float:
    labels = {"route": route, "method": method, "status": status}
    return value(samples, "broker_http_requests_total", **labels)


async def test_requests_are_counted_by_route_template_and_outcome_never_by_path(
    stack: Stack, http: httpx2.AsyncClient
) -> None:
    """Each answer lands in its route's series; flow ids, probed paths and keys appear nowhere."""
    broker = stack.broker
    _, before = await scrape(http, broker)
    owner, stranger = unique("metrics-owner"), unique("metrics-stranger")
    mcp = McpHttp(broker.mcp_url)
    owner_browser, stranger_browser = Browser(broker.url), Browser(broker.url)
    probe_path = f"/no-such-page-{secrets.token_hex(8)}"
    try:
        flow_id = await open_flow(mcp, stack.token(owner))
        listed = await mcp.post(request_body("tools/list", {}), token=stack.token(owner))
        unknown_tool = await mcp.call_tool(stack.token(owner), "no_such_tool")
        await stranger_browser.login_as(stranger)
        refused = await stranger_browser.get(f"/connect/{flow_id}")
        await owner_browser.login_as(owner)
        submitted = await submit_key(owner_browser, flow_id, KEY)
        missing = await http.get(f"{broker.url}{probe_path}")
    finally:
        await mcp.aclose()
        await owner_browser.http.aclose()
        await stranger_browser.http.aclose()
    text, after = await scrape(http, broker)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    validate_response(listed.json(), "ListToolsResult")
    assert unknown_tool.json()["error"]["code"] == -32602
    assert (refused.status_code, submitted.status_code, missing.status_code) == (403, 303, 404)
    mcp_posts = requests(after, "/mcp", "POST", "200") - requests(before, "/mcp", "POST", "200")
    assert mcp_posts == 3
    assert delta("broker_mcp_results_total", method="tools/call", result_type="input_required") == 1
    assert delta("broker_mcp_results_total", method="tools/list", result_type="complete") == 1
    assert delta("broker_mcp_errors_total", code="-32602") == 1
    connect_page = ("/connect/{flow_id}", "GET")
    assert requests(after, *connect_page, "403") - requests(before, *connect_page, "403") == 1
    key_form = ("/connect/{flow_id}/api-key", "POST", "303")
    assert requests(after, *key_form) - requests(before, *key_form) == 1
    assert requests(after, "unmatched", "GET", "404") - requests(before, "unmatched", "GET", "404")
    assert delta("broker_security_events_total", event="connect.identity_mismatch") == 1
    assert delta("broker_security_events_total", event="credential.stored") == 1
    mcp_timed = delta("broker_http_request_duration_seconds_count", route="/mcp")
    assert mcp_timed == 3
    assert value(after, "process_resident_memory_bytes") > 0
    for secret_or_id in (flow_id, probe_path, KEY, owner, stranger, SCRAPE_TOKEN):
        assert secret_or_id not in text


async def test_a_scrape_needs_the_configured_token_and_may_address_the_process_directly(
    stack: Stack, http: httpx2.AsyncClient
) -> None:
    """No token or a wrong one: 401 and no figures. The right one works with any Host header:
    Prometheus scrapes each replica by its own address, not by the public name."""
    url = f"{stack.broker.url}/metrics"

    anonymous = await http.get(url)
    wrong = await http.get(url, headers={"Authorization": f"Bearer {secrets.token_hex(32)}"})
    basic = await http.get(url, headers={"Authorization": f"Basic {SCRAPE_TOKEN}"})
    by_address = await http.get(
        url, headers={"Authorization": f"Bearer {SCRAPE_TOKEN}", "Host": "10.1.2.3:8000"}
    )

    for refused in (anonymous, wrong, basic):
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"].startswith("Bearer")
        assert "broker_http_requests_total" not in refused.text
    assert by_address.status_code == 200
    assert "broker_http_requests_total" in by_address.text
    assert by_address.headers["cache-control"] == "no-store"


async def test_without_a_configured_token_there_are_no_metrics(
    broker: BrokerProcess, http: httpx2.AsyncClient
) -> None:
    """The default: /metrics does not exist, whatever the request carries."""
    response = await http.get(
        f"{broker.url}/metrics", headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"}
    )

    assert response.status_code == 404
    assert "broker_http_requests_total" not in response.text


async def test_the_revocation_backlog_is_read_from_the_database_at_each_scrape(
    stack: Stack, http: httpx2.AsyncClient
) -> None:
    """Queued revocations (app/connect/revocations.py) show as a count and the age of the oldest:
    what an operator alerts on when a provider stops confirming. The value is the database's,
    not the process's, so any replica's scrape reports the same."""
    user = unique("metrics-backlog")
    now = utcnow()
    db = create_engine(stack.broker.database_url, pool_size=1)
    try:
        _, empty = await scrape(http, stack.broker)
        async with db.begin() as connection:
            await connection.execute(
                insert(PendingRevocation),
                [
                    {
                        "issuer": stack.idp.issuer,
                        "subject": user,
                        "provider": "github",
                        "audience": BROKER_AUDIENCE,
                        "sealed_credential": "v1.k.n.b",
                        "key_id": "k",
                        "attempts": attempts,
                        "next_attempt_at": now + timedelta(minutes=5),
                        "created_at": now - timedelta(seconds=age),
                    }
                    for attempts, age in ((3, 900), (1, 60))
                ],
            )
        text, queued = await scrape(http, stack.broker)
        async with db.begin() as connection:
            await connection.execute(
                delete(PendingRevocation).where(PendingRevocation.subject == user)
            )
        _, cleared = await scrape(http, stack.broker)
    finally:
        await db.dispose()

    assert value(empty, "broker_pending_revocations") == 0
    assert value(empty, "broker_pending_revocation_oldest_age_seconds") == 0
    assert value(queued, "broker_pending_revocations") == 2
    assert 900 <= value(queued, "broker_pending_revocation_oldest_age_seconds") < 960
    assert "# TYPE broker_pending_revocations gauge" in text
    assert user not in text
    assert value(cleared, "broker_pending_revocations") == 0
    assert value(cleared, "broker_pending_revocation_oldest_age_seconds") == 0


def test_without_the_backlog_its_gauges_are_left_out_not_reported_as_zero() -> None:
    """A scrape whose database read failed (app/main.py) has no backlog: an alert on the gauges'
    absence then fires, where a zero would say all is well."""
    metrics = BrokerMetrics()

    with_backlog = metrics.render(RevocationBacklog(pending=4, oldest_age_seconds=12.5)).decode()
    without = metrics.render(None).decode()

    assert "broker_pending_revocations 4.0" in with_backlog
    assert "broker_pending_revocation_oldest_age_seconds 12.5" in with_backlog
    assert "broker_pending_revocation" not in without
    assert "process_cpu_seconds_total" in without
