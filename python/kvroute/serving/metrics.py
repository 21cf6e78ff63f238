"""kvroute's Prometheus metrics (prometheus-client): what the router decided and what it holds.

Two kinds, on one registry:

* instruments the serving layer updates per request: `RouterMetrics.observe_decision`,
  `RouterMetrics.observe_upstream`, `RouterMetrics.observe_retry`,
  `RouterMetrics.set_circuit_open`;
* a collector that reads ``router.stats()`` at scrape time (in-flight requests, events and
  blocks applied, drops by reason, sequence gaps and recoveries, index size, degraded flags),
  so the numbers are the native core's own counters, never a copy that can drift;
* a collector that reads ``router.hit_rate`` (`kvroute.delivered.HitRateTracker`, fed by
  `kvroute.Router.report_delivered`) at scrape time: prompt tokens available / captured /
  delivered over the requests whose engine reported a cached-token count, and the
  prediction error per worker.

Exposed names (namespace ``kvroute`` by default; units in the names, counters end in
``_total``)::

    kvroute_decisions_total{policy, reason}            reason: normal | fallback | degraded
    kvroute_matched_token_ratio                        histogram, matched / prompt tokens
    kvroute_select_latency_seconds                     histogram, select_worker wall time
    kvroute_upstream_requests_total{worker, outcome}   outcome: 2xx | 4xx | 5xx | <error kind>
    kvroute_upstream_latency_seconds{worker}           histogram
    kvroute_retries_total
    kvroute_circuit_open{worker}                       1 while the breaker is open
    kvroute_inflight_requests{worker}                  from router.stats() at scrape time
    kvroute_pending_prefill_tokens{worker}
    kvroute_reported_requests_waiting{worker}          engine-reported queue (update_load)
    kvroute_reported_kv_cache_usage_ratio{worker}      engine-reported, when reported
    kvroute_events_applied_total
    kvroute_blocks_stored_total{worker}
    kvroute_blocks_removed_total{worker}
    kvroute_dropped_batches_total{worker, reason}      wire / consistency drops by reason
    kvroute_sequence_gaps_total{worker}
    kvroute_recovered_batches_total{worker}            filled from the replay socket
    kvroute_indexed_blocks{worker}
    kvroute_index_block_keys                           distinct block keys in the index
    kvroute_index_memory_bytes
    kvroute_speculative_blocks                         blocks of live speculative credits
    kvroute_speculative_dropped_total                  credits dropped by max_speculative_blocks
    kvroute_worker_degraded{worker}                    1 while the worker's state is degraded
    kvroute_prefix_tokens_total{kind}                  kind: available | captured | delivered
    kvroute_prefix_prediction_error{worker}            histogram, (captured - delivered) / prompt
    kvroute_delivered_reports_total{worker, reported}  reported: true | false (no count)

Thread-safety: prometheus-client instruments are thread-safe; the collector only calls the
thread-safe ``router.stats()``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterator, Optional, Set, Tuple, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample

__all__ = ["RouterMetrics", "decision_reason", "upstream_outcome"]

#: Matched-token ratio buckets: 0 (a miss) to 1 (the whole prompt cached), by tenths.
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
#: select_worker latency buckets, seconds (microseconds to tens of milliseconds).
SELECT_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                  5e-3, 1e-2, 5e-2)
#: Upstream request latency buckets, seconds (LLM requests: tens of ms to minutes).
UPSTREAM_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0)

#: Semantic response-cache similarity buckets (cosine).
SIMILARITY_BUCKETS = (0.5, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0)

_OUTCOME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def decision_reason(decision: Any) -> str:
    """The ``reason`` label of a decision: ``"fallback"`` when the fallback policy decided
    (no events yet, every worker degraded, LMCache controller down), else ``"degraded"`` when
    the chosen worker's index state is degraded, else ``"normal"``."""
    if decision.fallback:
        return "fallback"
    if decision.degraded:
        return "degraded"
    return "normal"


def upstream_outcome(status: Union[int, str]) -> str:
    """The ``outcome`` label of an upstream result: an HTTP status as its class (``"2xx"``,
    ``"4xx"``, ``"5xx"``...; ``"other"`` for an int outside ``[100, 599]``, which a
    misbehaving upstream can send), or an error kind as given (``"connect_error"``,
    ``"timeout"``, ``"disconnect"``...: lowercase letters, digits and ``_``, at most 32
    characters).

    Raises ValueError for anything else (an unbounded label set would grow without end)."""
    if isinstance(status, bool):
        raise ValueError(f"upstream status must be an HTTP status or an error kind, got {status!r}")
    if isinstance(status, int):
        # Deliberately counted, not raised: the status comes from the worker, and a metric
        # must never fail the request it describes.
        if not 100 <= status <= 599:
            return "other"
        return f"{status // 100}xx"
    if isinstance(status, str) and _OUTCOME.match(status):
        return status
    raise ValueError(f"upstream status must be an HTTP status (int) or an error kind like "
                     f"'connect_error' ([a-z][a-z0-9_]*, <= 32 chars), got {status!r}")


class _StatsCollector:
    """Families built from ``router.stats()`` at scrape time."""

    def __init__(self, router: Any, namespace: str) -> None:
        self._router = router
        self._ns = namespace

    def _families(self, stats: Dict[str, Any]) -> Iterator[Metric]:
        ns = self._ns
        workers: Dict[str, Dict[str, Any]] = stats.get("workers", {})

        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{ns}_{name}", doc, labels=["worker"])
            for w, s in workers.items():
                v = s.get(key)
                if v is not None:
                    g.add_metric([w], float(v))
            return g

        def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{ns}_{name}", doc, labels=["worker"])
            for w, s in workers.items():
                c.add_metric([w], float(s.get(key) or 0))
            return c

        yield gauge("inflight_requests", "Requests routed to the worker and not yet completed.",
                    "inflight_requests")
        yield gauge("pending_prefill_tokens", "Prompt tokens the router expects the worker "
                    "still has to prefill (released at first token).", "pending_prefill_tokens")
        yield gauge("reported_requests_waiting", "Engine-reported queue length "
                    "(num_requests_waiting given to update_load).", "num_requests_waiting")
        yield gauge("reported_kv_cache_usage_ratio", "Engine-reported KV-cache usage in [0, 1] "
                    "(absent until reported).", "kv_cache_usage_perc")
        total = CounterMetricFamily(f"{ns}_events_applied", "KV events applied to the index.")
        total.add_metric([], float(stats.get("events_applied") or 0))
        yield total
        yield counter("blocks_stored", "Blocks indexed from BlockStored events.", "blocks_stored")
        yield counter("blocks_removed", "Blocks unindexed by BlockRemoved events.",
                      "blocks_removed")
        dropped = CounterMetricFamily(f"{ns}_dropped_batches", "KV-event batches or parts "
                                      "dropped, by reason.", labels=["worker", "reason"])
        for w, s in workers.items():
            for reason, n in sorted((s.get("dropped") or {}).items()):
                dropped.add_metric([w, reason], float(n))
        yield dropped
        yield counter("sequence_gaps", "Gaps in the worker's event sequence numbers.", "gaps")
        yield counter("recovered_batches", "Missing batches recovered from the worker's replay "
                      "socket.", "batches_recovered")
        yield gauge("indexed_blocks", "Blocks of the worker in the index.", "indexed_blocks")
        keys = GaugeMetricFamily(f"{ns}_index_block_keys", "Distinct block keys in the index.")
        keys.add_metric([], float(stats.get("distinct_block_keys") or 0))
        yield keys
        mem = GaugeMetricFamily(f"{ns}_index_memory_bytes", "Memory held by the block index.")
        mem.add_metric([], float(stats.get("index_memory_bytes") or 0))
        yield mem
        spec = GaugeMetricFamily(f"{ns}_speculative_blocks", "Blocks of live speculative "
                                 "credits (decisions' unmatched blocks, until speculative_ttl_s).")
        spec.add_metric([], float(stats.get("speculative_entries") or 0))
        yield spec
        spec_dropped = CounterMetricFamily(f"{ns}_speculative_dropped", "Speculative credits "
                                           "dropped before expiry by max_speculative_blocks.")
        spec_dropped.add_metric([], float(stats.get("speculative_dropped") or 0))
        yield spec_dropped
        degraded = GaugeMetricFamily(f"{ns}_worker_degraded", "1 while the worker's indexed "
                                     "state is degraded (lost events), else 0.", labels=["worker"])
        for w, s in workers.items():
            degraded.add_metric([w], 1.0 if s.get("state") == "degraded" else 0.0)
        yield degraded

    def describe(self) -> Iterator[Metric]:
        return self._families({"workers": {}})

    def collect(self) -> Iterator[Metric]:
        # Deliberately empty on failure (e.g. a closed router): /metrics keeps serving the
        # request-path instruments instead of failing the whole scrape.
        try:
            stats = self._router.stats()
        except Exception:  # noqa: BLE001
            return iter(())
        return self._families(stats)


class _HitRateCollector:
    """Families built from ``router.hit_rate.snapshot()`` at scrape time."""

    def __init__(self, router: Any, namespace: str) -> None:
        self._router = router
        self._ns = namespace

    def _families(self, snap: Dict[str, Any]) -> Iterator[Metric]:
        ns = self._ns
        tokens = CounterMetricFamily(
            f"{ns}_prefix_tokens", "Prompt tokens of the requests whose engine reported a "
            "cached-token count: available (best match any worker held at decision time), "
            "captured (the chosen worker's match), delivered (the engine's cached tokens).",
            labels=["kind"])
        for kind in ("available", "captured", "delivered"):
            tokens.add_metric([kind], float(snap.get("totals", {}).get(kind, 0)))
        yield tokens
        err = HistogramMetricFamily(
            f"{ns}_prefix_prediction_error", "Per request, (captured - delivered) / prompt "
            "tokens: > 0 when the engine reused less than the router expected.",
            labels=["worker"])
        reports = CounterMetricFamily(
            f"{ns}_delivered_reports", "Finished requests reported with report_delivered, by "
            "whether the engine's response carried a cached-token count.",
            labels=["worker", "reported"])
        for w, h in snap.get("workers", {}).items():
            if h["buckets"]:
                buckets = [(_le(ub), float(n)) for ub, n in h["buckets"]]
                err.add_metric([w], buckets, sum_value=float(h["error_sum"]))
                if not err.samples[-1].name.endswith("_sum"):
                    # prometheus-client leaves out _count and _sum when a bucket bound is
                    # negative (OpenMetrics' rule); Prometheus' text format, which /metrics
                    # serves, has them, and the mean error is _sum / _count.
                    err.samples.append(Sample(err.name + "_count", {"worker": w},
                                              buckets[-1][1]))
                    err.samples.append(Sample(err.name + "_sum", {"worker": w},
                                              float(h["error_sum"])))
            reports.add_metric([w, "true"], float(h["reports"]))
            reports.add_metric([w, "false"], float(h["unreported"]))
        yield err
        yield reports

    def describe(self) -> Iterator[Metric]:
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        hits = getattr(self._router, "hit_rate", None)
        if hits is None:
            return iter(())
        return self._families(hits.snapshot())


def _le(ub: float) -> str:
    return "+Inf" if ub == float("inf") else repr(float(ub))


class RouterMetrics:
    """kvroute's Prometheus metrics for one router (names in the module docstring).

    Parameters
    ----------
    router:
        The `kvroute.Router` whose ``stats()`` the collector reads at scrape time.
    registry:
        Where to register; default a new ``CollectorRegistry`` of our own (so several
        routers, or tests, never collide). Pass ``prometheus_client.REGISTRY`` to share the
        process default registry.
    namespace:
        Metric name prefix.

    Raises
    ------
    ValueError
        A namespace that is not a valid metric name prefix, or names already registered in
        ``registry`` (prometheus-client's "Duplicated timeseries").
    """

    def __init__(self, router: Any, registry: Optional[CollectorRegistry] = None,
                 namespace: str = "kvroute") -> None:
        if not isinstance(namespace, str) or not re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", namespace):
            raise ValueError(f"namespace must match [a-zA-Z_][a-zA-Z0-9_]*, got {namespace!r}")
        self.router = router
        self.namespace = namespace
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        self.decisions = Counter("decisions", "Routing decisions, by the policy that decided and "
                                 "reason (normal / fallback / degraded).",
                                 ["policy", "reason"], namespace=namespace, registry=reg)
        self.matched_token_ratio = Histogram(
            "matched_token_ratio", "Prompt tokens the chosen worker holds as a cached prefix, "
            "over prompt tokens.", buckets=RATIO_BUCKETS, namespace=namespace, registry=reg)
        self.select_latency = Histogram("select_latency_seconds", "Wall time of select_worker.",
                                        buckets=SELECT_BUCKETS, namespace=namespace, registry=reg)
        self.upstream_requests = Counter("upstream_requests", "Requests sent to workers, by "
                                         "outcome (HTTP status class or error kind).",
                                         ["worker", "outcome"], namespace=namespace, registry=reg)
        self.upstream_latency = Histogram("upstream_latency_seconds", "Time from sending a "
                                          "request to a worker to the end of its response.",
                                          ["worker"], buckets=UPSTREAM_BUCKETS,
                                          namespace=namespace, registry=reg)
        self.retries = Counter("retries", "Requests retried on another worker after a "
                               "connection failure.", namespace=namespace, registry=reg)
        self.circuit_open = Gauge("circuit_open", "1 while the worker's circuit breaker is "
                                  "open, else 0.", ["worker"], namespace=namespace, registry=reg)
        self.tenant_requests = Counter("tenant_requests", "Requests on the public routes by "
                                       "tenant (API key) and outcome: the answer's status "
                                       "class, or why the router refused it (missing_key, "
                                       "bad_key, revoked, rate_limit, concurrency, model).",
                                       ["tenant", "outcome"], namespace=namespace, registry=reg)
        self.response_cache = Counter("response_cache_requests", "Cacheable requests looked up "
                                      "in the response cache, by result (hit / miss).",
                                      ["result"], namespace=namespace, registry=reg)
        self.cache_similarity = Histogram(
            "response_cache_similarity", "Semantic response cache: cosine similarity of a "
            "request to the most similar stored one (per lookup that had one).",
            buckets=SIMILARITY_BUCKETS, namespace=namespace, registry=reg)
        # Label values seen per worker, so forget_worker can remove exactly those series.
        self._outcomes: Dict[str, Set[str]] = {}
        self._timed: Set[str] = set()
        self._breakers: Set[str] = set()
        self._collector = _StatsCollector(router, namespace)
        self.registry.register(self._collector)
        self._hit_collector = _HitRateCollector(router, namespace)
        self.registry.register(self._hit_collector)

    # -- request path ------------------------------------------------------------------------
    def observe_decision(self, decision: Any, select_seconds: Optional[float] = None) -> None:
        """Counts one routing decision.

        Parameters
        ----------
        decision:
            The `kvroute.Decision` (its ``policy``, ``fallback``, ``degraded``,
            ``matched_tokens``, ``prompt_tokens``).
        select_seconds:
            Wall time of the ``select_worker`` call, in seconds (None: not observed).
        """
        if select_seconds is not None:
            self._check_seconds(select_seconds, "select_seconds")
        self.decisions.labels(decision.policy, decision_reason(decision)).inc()
        if decision.prompt_tokens > 0:
            self.matched_token_ratio.observe(decision.matched_tokens / decision.prompt_tokens)
        if select_seconds is not None:
            self.select_latency.observe(select_seconds)

    def observe_upstream(self, worker: str, status: Union[int, str],
                         seconds: Optional[float] = None) -> None:
        """Counts one upstream request to ``worker``.

        Parameters
        ----------
        worker:
            Worker name (``decision.worker``).
        status:
            The HTTP status (int) or an error kind (``"connect_error"``, ``"timeout"``,
            ``"disconnect"``, ...): see `upstream_outcome`.
        seconds:
            Time to the end of the response (or to the failure), in seconds.

        Raises
        ------
        ValueError
            A status that is neither an int nor an error kind (see `upstream_outcome`),
            negative or NaN seconds.
        """
        outcome = upstream_outcome(status)
        if seconds is not None:
            self._check_seconds(seconds, "seconds")
        self.upstream_requests.labels(worker, outcome).inc()
        self._outcomes.setdefault(worker, set()).add(outcome)
        if seconds is not None:
            self.upstream_latency.labels(worker).observe(seconds)
            self._timed.add(worker)

    def observe_tenant(self, tenant: str, status: Union[int, str]) -> None:
        """Counts one public-route request of ``tenant`` (``""`` when the key is unknown or
        missing) with its HTTP status or refusal reason (see `upstream_outcome`)."""
        self.tenant_requests.labels(tenant, upstream_outcome(status)).inc()

    def observe_cache(self, result: str) -> None:
        """Counts one response-cache lookup: ``"hit"``, ``"semantic_hit"`` or ``"miss"``."""
        self.response_cache.labels(result).inc()

    def observe_similarity(self, similarity: float) -> None:
        """Observes one semantic-cache similarity (cosine, [-1, 1])."""
        self.cache_similarity.observe(similarity)

    def observe_retry(self, n: int = 1) -> None:
        """Counts ``n`` retries on another worker."""
        self.retries.inc(n)

    def set_circuit_open(self, worker: str, is_open: bool) -> None:
        """Sets ``kvroute_circuit_open{worker}`` to 1 (open) or 0 (closed)."""
        self.circuit_open.labels(worker).set(1.0 if is_open else 0.0)
        self._breakers.add(worker)

    def forget_worker(self, worker: str) -> None:
        """Drops the per-worker series of the request-path instruments for a removed worker
        (the collector's series follow ``router.stats()`` by themselves). Idempotent."""
        for outcome in self._outcomes.pop(worker, set()):
            self.upstream_requests.remove(worker, outcome)
        if worker in self._timed:
            self._timed.discard(worker)
            self.upstream_latency.remove(worker)
        if worker in self._breakers:
            self._breakers.discard(worker)
            self.circuit_open.remove(worker)

    @staticmethod
    def _check_seconds(v: float, name: str) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative number of seconds, got {v!r}")

    # -- exposition --------------------------------------------------------------------------
    def render(self) -> Tuple[bytes, str]:
        """The registry in the Prometheus text format: ``(body, content_type)`` for a
        ``/metrics`` response (``generate_latest`` / ``CONTENT_TYPE_LATEST``)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def unregister(self) -> None:
        """Removes every kvroute metric from the registry (e.g. before a router is replaced)."""
        for c in (self.decisions, self.matched_token_ratio, self.select_latency,
                  self.upstream_requests, self.upstream_latency, self.retries, self.circuit_open,
                  self.tenant_requests, self.response_cache, self.cache_similarity,
                  self._collector, self._hit_collector):
            self.registry.unregister(c)
