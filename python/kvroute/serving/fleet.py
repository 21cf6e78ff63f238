"""The one-pool front's view of its fleet: ``GET /workers`` and ``GET /v1/models``.

Functions of a `kvroute.serving.proxy.Proxy` (``self``), run on its event loop.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping

import httpx
from starlette.responses import JSONResponse, Response

from kvroute.serving.common import WORKER_HEADER, error_response, jsonable

__all__ = ["workers_view", "models"]


def workers_view(self: Any) -> Dict[str, Any]:
    """``GET /workers``: per worker its URL, data-parallel rank, index ``state``
    (``exact``, ``recovering``, ``degraded``, ``stale``), ``degraded`` (degraded or stale),
    ``indexed_blocks``, load (``inflight_requests``,
    ``pending_prefill_tokens``, ``num_requests_waiting``, ``kv_cache_usage_perc``),
    event counters, ``last_recv_age_s``, ``circuit`` (`CircuitBreaker.snapshot`),
    ``health`` (``healthy``, ``streak``; ``None`` without health checks or before the
    first probe), ``recovery_share`` (`kvroute.serving.health.RecoveryRamp`: 1 unless
    recovering), ``scrape`` (the scraper's status of that worker, ``None`` when
    scraping is off) and ``prefix_tokens`` (prompt tokens over the requests whose cached
    count came back: ``available``, ``captured``, ``delivered``, ``reports``; see
    `kvroute.Router.report_delivered`); plus the index totals, ``hit_rate`` (the same
    sums over every worker), ``limits`` (`RequestLimits.as_dict`) and ``tokenizer_lanes``
    (`PromptTokenizer.lanes`, ``None`` without one); with replicas, the other replicas'
    ``peer_inflight_requests`` / ``peer_pending_prefill_tokens`` per worker and
    ``replicas`` (`kvroute.serving.replicas.Replicas.status`, else None)."""
    st = self.router.stats()
    hits = self.router.hit_rate.snapshot()
    scrape = self._scraper.status() if self._scraper is not None else {}
    keys = ("state", "indexed_blocks", "inflight_requests", "pending_prefill_tokens",
            "num_requests_waiting", "kv_cache_usage_perc", "last_recv_age_s", "events",
            "batches", "gaps", "batches_recovered", "replays", "reconnects", "resets",
            "dropped", "peer_inflight_requests", "peer_pending_prefill_tokens")
    out: Dict[str, Any] = {}
    for w in self.router.workers:
        ws = st["workers"].get(w.name, {})
        row: Dict[str, Any] = {"url": w.url, "dp_rank": w.dp_rank,
                               "kv_endpoint": w.kv_endpoint}
        row.update({k: ws.get(k) for k in keys})
        # stale (silent past stale_after_s) is routed as degraded: both are not exact
        row["degraded"] = ws.get("state") in ("degraded", "stale")
        row["circuit"] = self.breaker(w.name).snapshot()
        row["health"] = (self._health.status().get(self.base_url(w.url))
                         if self._health is not None else None)
        row["recovery_share"] = round(self.ramp.share(self._recovered_at(w)), 3)
        row["scrape"] = jsonable(scrape.get(w.name)) if isinstance(scrape, Mapping) else None
        wh = hits["workers"].get(w.name, {})
        row["prefix_tokens"] = {k: wh.get(k, 0) for k in ("available", "captured",
                                                           "delivered", "reports")}
        out[w.name] = row
    return {"workers": out,
            "index": {k: st.get(k) for k in ("events_applied", "distinct_block_keys",
                                              "indexed_entries", "index_memory_bytes",
                                              "dropped")},
            "policy": self.router.policy, "block_size": self.router.block_size,
            "hit_rate": {**hits["totals"], "reports": hits["reports"],
                         "unreported": hits["unreported"]},
            "limits": self.limits.as_dict(),
            "tokenizer_lanes": (self.tokenizer.lanes()
                                if hasattr(self.tokenizer, "lanes") else None),
            "replicas": self.replicas.status() if self.replicas is not None else None}


async def models(self: Any) -> Response:
    """``GET /v1/models``: the first available worker's answer, else the configured model;
    503 (with ``Retry-After``) when no worker is available or none answered and no model
    is configured."""
    await self._ensure_started()
    assert self._client is not None
    workers = self._workers()
    if not any(self._up(n) for n in workers):
        return error_response(503, f"no worker available among {len(workers)}",
                              headers={"Retry-After": str(self._retry_after_s())})
    for name, w in workers.items():
        if not self._up(name):
            continue
        try:
            r = await self._client.get(self.base_url(w.url) + "/v1/models",
                                       timeout=min(self.upstream_timeout_s, 10.0))
        except (httpx.HTTPError, httpx.InvalidURL):
            continue
        if r.status_code == 200:
            if self.limits.auto and self.limits.max_prompt_tokens is None:
                try:
                    self.limits.learn_max_model_len(
                        m.get("max_model_len") for m in r.json().get("data", [])
                        if isinstance(m, dict))
                except (ValueError, AttributeError):
                    pass
            return Response(content=r.content, status_code=200,
                            headers={"content-type": r.headers.get("content-type",
                                                                   "application/json"),
                                     WORKER_HEADER: name})
    if self.model:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": int(time.time()),
             "owned_by": "kvroute", "root": self.model, "parent": None}]})
    return error_response(503, "no worker answered /v1/models and no model is configured",
                          headers={"Retry-After": str(self._retry_after_s())})
