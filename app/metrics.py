"""Prometheus metrics for `GET /metrics`: requests by route, latency, MCP outcomes, security
events, the revocation queue, webhook deliveries, and the process's own CPU, memory and file
descriptors.

Counting happens on the hot paths, so it is plain dictionary arithmetic on the event loop's thread
(about a microsecond a request); prometheus_client only renders the text at scrape time. Every
label value comes from a fixed set: route templates (`/connect/{flow_id}`, never the path itself,
which would put flow ids in the metrics and let a client create series at will), known methods,
status codes, result types and event names written in the code.

The revocation queue and the webhooks' backlogs are read from the database at scrape time
(app/operations.py), so they are the same from every process. Everything else each process
counts for itself: with `serve --workers N` a scrape reports the worker that answered it. Run
one worker per replica and let Prometheus scrape each replica when exact totals matter.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST
Labels = tuple[str, ...]  # one series' label values, in the family's label order
UNMATCHED_ROUTE = "unmatched"  # no route answered (404s, refused Hosts): never the raw path
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# seconds; the request bound (5 s, SECURITY.md R5) falls between the last two
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RevocationBacklog(NamedTuple):
    """The revocation queue as read at scrape time: database-wide, the same from every process."""

    pending: int
    oldest_age_seconds: float  # 0 when nothing is pending


class _Durations:
    """One histogram series: counts per bucket (not yet cumulative) and the sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        bounds = [*(repr(bound) for bound in DURATION_BUCKETS), "+Inf"]
        running, cumulative = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        return cumulative


class BrokerMetrics(Collector):
    """The broker's own counters, rendered with the process collectors of one registry."""

    def __init__(self) -> None:
        self.requests: defaultdict[Labels, int] = defaultdict(int)
        self.durations: defaultdict[str, _Durations] = defaultdict(_Durations)
        self.mcp_results: defaultdict[Labels, int] = defaultdict(int)
        self.mcp_errors: defaultdict[Labels, int] = defaultdict(int)
        self.security_events: defaultdict[Labels, int] = defaultdict(int)
        self.rate_limited: defaultdict[Labels, int] = defaultdict(int)
        self.webhook_deliveries: defaultdict[Labels, int] = defaultdict(int)
        self.webhooks_abandoned: defaultdict[Labels, int] = defaultdict(int)
        self.clock_skew_seconds: float | None = None  # set by the housekeeping (PostgreSQL)
        self._backlog: RevocationBacklog | None = None
        self._webhook_backlog: Mapping[str, int] | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(self)

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        """`route`: the matched route's template, or UNMATCHED_ROUTE."""
        verb = method if method in METHODS else "other"
        self.requests[route, verb, str(status)] += 1
        self.durations[route].observe(seconds)

    def mcp_result(self, method: str, result_type: str) -> None:
        self.mcp_results[method, result_type] += 1

    def mcp_error(self, code: int) -> None:
        self.mcp_errors[(str(code),)] += 1

    def security_event(self, event: str) -> None:
        self.security_events[(event,)] += 1

    def refused(self, limit: str) -> None:
        """A request refused for a spent budget: `limit` is "user" or "failed_auths"."""
        self.rate_limited[(limit,)] += 1

    def webhook_delivery(self, webhook: str, outcome: str) -> None:
        """One post to `webhook` (a configured name): `outcome` "ok" (2xx) or "failed"."""
        self.webhook_deliveries[webhook, outcome] += 1

    def webhook_abandoned(self, webhook: str, count: int = 1) -> None:
        self.webhooks_abandoned[(webhook,)] += count

    def render(
        self, backlog: RevocationBacklog | None, webhooks: Mapping[str, int] | None = None
    ) -> bytes:
        """The registry's text; `backlog` None (the database did not answer) leaves its gauges
        out, so an alert on their absence fires rather than one on a stale value; `webhooks`
        (events waiting, per webhook) likewise."""
        self._backlog, self._webhook_backlog = backlog, webhooks
        try:
            return generate_latest(self.registry)
        finally:
            self._backlog, self._webhook_backlog = None, None

    def collect(self) -> Iterator[Metric]:
        yield _counter(
            "broker_http_requests",
            "HTTP requests answered, by route template, method and status",
            ("route", "method", "status"),
            self.requests,
        )
        durations = HistogramMetricFamily(
            "broker_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, by route template",
            labels=("route",),
        )
        for route, series in sorted(self.durations.items()):
            durations.add_metric((route,), series.buckets(), series.total)
        yield durations
        yield _counter(
            "broker_mcp_results",
            "MCP requests answered with a result, by method and resultType",
            ("method", "result_type"),
            self.mcp_results,
        )
        yield _counter(
            "broker_mcp_errors",
            "MCP requests answered with a JSON-RPC error, by code",
            ("code",),
            self.mcp_errors,
        )
        yield _counter(
            "broker_security_events",
            "Security events (the security log's event names), by event",
            ("event",),
            self.security_events,
        )
        yield _counter(
            "broker_rate_limited",
            "Requests refused (429) for a spent rate-limit budget, by limit (user, failed_auths)",
            ("limit",),
            self.rate_limited,
        )
        yield _counter(
            "broker_webhook_deliveries",
            "Posts of events to webhooks, by webhook and outcome (ok: 2xx; failed)",
            ("webhook", "outcome"),
            self.webhook_deliveries,
        )
        yield _counter(
            "broker_webhook_abandoned",
            "Events given up 24 hours after they occurred, undelivered, by webhook",
            ("webhook",),
            self.webhooks_abandoned,
        )
        if self._webhook_backlog is not None:
            waiting = GaugeMetricFamily(
                "broker_webhook_backlog",
                "Events waiting to be delivered, by webhook",
                labels=("webhook",),
            )
            for webhook, count in sorted(self._webhook_backlog.items()):
                waiting.add_metric((webhook,), count)
            yield waiting
        if self.clock_skew_seconds is not None:
            yield GaugeMetricFamily(
                "broker_clock_skew_seconds",
                "This process's clock ahead of the database's (behind: negative), as the last "
                "housekeeping round measured it (PostgreSQL only)",
                value=self.clock_skew_seconds,
            )
        if self._backlog is not None:
            yield GaugeMetricFamily(
                "broker_pending_revocations",
                "Disconnected grants whose revocation the provider has not confirmed yet",
                value=self._backlog.pending,
            )
            yield GaugeMetricFamily(
                "broker_pending_revocation_oldest_age_seconds",
                "Time since the oldest of those grants was disconnected (0 when there is none)",
                value=self._backlog.oldest_age_seconds,
            )


def _counter(
    name: str, documentation: str, labels: tuple[str, ...], counts: Mapping[Labels, int]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels)
    for values, count in sorted(counts.items()):
        family.add_metric(values, count)
    return family
