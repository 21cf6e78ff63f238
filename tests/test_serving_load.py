"""kvroute.serving.load: vLLM's ORCA load header and the /metrics scraper, against real HTTP
servers on loopback (an engine stand-in speaking vLLM's header and metrics formats)."""

from __future__ import annotations

import asyncio
import time
from typing import Dict, Tuple

import pytest
from _util import UvicornThread, await_for, free_port, require

httpx = require("httpx")
fastapi = require("fastapi")
uvicorn = require("uvicorn")
require("prometheus_client")

from fastapi import Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402

from kvroute import Router  # noqa: E402
from kvroute.serving.load import (  # noqa: E402
    ORCA_REQUEST_HEADER,
    ORCA_RESPONSE_HEADER,
    PrometheusScraper,
    apply_orca,
    orca_request_headers,
    parse_orca_header,
    parse_vllm_metrics,
)

MODEL = "Qwen/Qwen3-0.6B"


def vllm_metrics(engines: Dict[int, Tuple[float, float, float]]) -> str:
    """/metrics text as a vLLM server with one engine per data-parallel rank writes it:
    {engine: (running, waiting, kv_cache_usage_perc)}; HELP/TYPE lines as vLLM's loggers."""
    fams = [("vllm:num_requests_running", "Number of requests in model execution batches.", 0),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 1),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", 2)]
    out = []
    for name, doc, i in fams:
        out += [f"# HELP {name} {doc}", f"# TYPE {name} gauge"]
        out += [f'{name}{{engine="{e}",model_name="{MODEL}"}} {float(v[i])}'
                for e, v in engines.items()]
    out += ["# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter"]
    out += [f'vllm:prompt_tokens_total{{engine="{e}",model_name="{MODEL}"}} 1234.0'
            for e in engines]
    return "\n".join(out) + "\n"


class Engine(UvicornThread):
    """A real HTTP server on 127.0.0.1 standing in for a vLLM engine's API server: /metrics in
    vLLM's exposition format and a non-streaming /v1/completions that attaches the ORCA load
    header when asked (as vllm/entrypoints/serve/utils/orca_metrics.py does)."""

    def __init__(self) -> None:
        app = fastapi.FastAPI()
        self.metrics_text = vllm_metrics({0: (1, 0, 0.0)})
        self.metrics_status = 200
        self.orca: Dict[str, float] = {"kv_cache_usage_perc": 0.5, "num_requests_waiting": 4.0}
        self.orca_override = None  # a raw header value, to send malformed reports

        @app.get("/metrics")
        def metrics():
            return PlainTextResponse(self.metrics_text, status_code=self.metrics_status)

        @app.post("/v1/completions")
        async def completions(request: Request):
            fmt = request.headers.get(ORCA_REQUEST_HEADER, "")
            headers = {}
            if self.orca_override is not None:
                headers[ORCA_RESPONSE_HEADER] = self.orca_override
            elif fmt.upper() == "TEXT":
                headers[ORCA_RESPONSE_HEADER] = "TEXT " + ", ".join(
                    f"named_metrics.{k}={v}" for k, v in self.orca.items())
            elif fmt.upper() == "JSON":
                import json

                headers[ORCA_RESPONSE_HEADER] = "JSON " + json.dumps(
                    {"named_metrics": self.orca})
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": []},
                                headers=headers)

        super().__init__(app)


@pytest.fixture
def engines():
    made = []

    def make() -> Engine:
        made.append(Engine())
        return made[-1]

    yield make
    for e in made:
        e.stop()


def load_of(router: Router, worker: str) -> Tuple[float, object]:
    s = router.stats()["workers"][worker]
    return s["num_requests_waiting"], s["kv_cache_usage_perc"]


# -- ORCA ------------------------------------------------------------------------------------


def test_parse_orca_header_both_formats():
    assert parse_orca_header("TEXT named_metrics.kv_cache_usage_perc=0.4, "
                             "named_metrics.num_requests_waiting=2.0") == {
        "named_metrics.kv_cache_usage_perc": 0.4, "named_metrics.num_requests_waiting": 2.0}
    assert parse_orca_header('JSON {"named_metrics": {"kv_cache_usage_perc": 0.4}, '
                             '"cpu_utilization": 0.3}') == {
        "named_metrics.kv_cache_usage_perc": 0.4, "cpu_utilization": 0.3}
    # Without the format prefix (some servers omit it), and with no metrics at all.
    assert parse_orca_header("named_metrics.a=1,named_metrics.b=2.5") == {
        "named_metrics.a": 1.0, "named_metrics.b": 2.5}
    assert parse_orca_header('{"named_metrics": {"a": 1}}') == {"named_metrics.a": 1.0}
    assert parse_orca_header("TEXT") == {} and parse_orca_header("text ") == {}
    with pytest.raises(ValueError, match="expected TEXT key=number"):
        parse_orca_header("TEXT named_metrics.a")
    with pytest.raises(ValueError, match="'abc' is not a number"):
        parse_orca_header("TEXT named_metrics.a=abc")
    with pytest.raises(ValueError, match='expected JSON {"named_metrics"'):
        parse_orca_header("JSON {not json")
    with pytest.raises(ValueError, match="must be a number"):
        parse_orca_header('JSON {"named_metrics": {"a": "high"}}')
    with pytest.raises(ValueError, match="expected TEXT key=number"):
        parse_orca_header("BIN AAAA")


def test_orca_request_headers():
    assert orca_request_headers() == {"endpoint-load-metrics-format": "TEXT"}
    assert orca_request_headers("json") == {"endpoint-load-metrics-format": "JSON"}
    with pytest.raises(ValueError, match="'TEXT' or 'JSON'"):
        orca_request_headers("BIN")


@pytest.mark.parametrize("fmt", ["TEXT", "JSON"])
def test_apply_orca_from_a_real_response(engines, fmt):
    eng = engines()
    with Router([eng.url, "http://other"]) as router, httpx.Client(timeout=10) as client:
        plain = client.post(f"{eng.url}/v1/completions", json={"prompt": "hi"})
        assert apply_orca(router, eng.url, plain.headers) is False  # not asked, not sent
        assert load_of(router, eng.url) == (0.0, None)

        resp = client.post(f"{eng.url}/v1/completions", json={"prompt": "hi"},
                           headers=orca_request_headers(fmt))
        assert resp.headers[ORCA_RESPONSE_HEADER].startswith(fmt)
        assert apply_orca(router, eng.url, resp.headers) is True
        assert load_of(router, eng.url) == (4.0, 0.5)
        assert load_of(router, "http://other") == (0.0, None)

        # A malformed report is logged and ignored: the request must not fail because of it.
        eng.orca_override = "TEXT named_metrics.kv_cache_usage_perc=lots"
        bad = client.post(f"{eng.url}/v1/completions", json={"prompt": "hi"},
                          headers=orca_request_headers(fmt))
        assert apply_orca(router, eng.url, bad.headers) is False
        assert load_of(router, eng.url) == (4.0, 0.5)
        # Out-of-range usage is clamped to [0, 1]; a plain dict works too.
        assert apply_orca(router, eng.url, {"Endpoint-Load-Metrics":
                                            "TEXT named_metrics.kv_cache_usage_perc=1.5"})
        assert load_of(router, eng.url) == (4.0, 1.0)
        with pytest.raises(KeyError):
            apply_orca(router, "http://nobody", resp.headers)


# -- Prometheus scraper ----------------------------------------------------------------------


def test_parse_vllm_metrics_sums_requests_and_takes_the_fullest_engine():
    text = vllm_metrics({0: (2, 3, 0.25), 1: (1, 2, 0.6)})
    assert parse_vllm_metrics(text) == {"num_requests_waiting": 5.0,
                                        "num_requests_running": 3.0,
                                        "kv_cache_usage_perc": 0.6}
    legacy = text.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_vllm_metrics(legacy)["kv_cache_usage_perc"] == 0.6
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        parse_vllm_metrics("<html><body>502 Bad Gateway</body></html>\n")
    with pytest.raises(ValueError, match="no vllm:num_requests_waiting"):
        parse_vllm_metrics("# TYPE up gauge\nup 1\n")


def test_scraper_feeds_the_router_and_follows_changes(engines):
    a, b = engines(), engines()
    a.metrics_text = vllm_metrics({0: (2, 3, 0.25), 1: (1, 2, 0.6)})
    b.metrics_text = vllm_metrics({0: (7, 0, 0.1)})

    async def main():
        with Router([a.url, b.url]) as router:
            scraper = PrometheusScraper(router, {a.url: f"{a.url}/metrics",
                                                 b.url: f"{b.url}/metrics"}, timeout_s=10)
            try:
                await scraper.scrape_once()
                # waiting only: running requests are the router's own in-flight ones
                assert load_of(router, a.url) == (5.0, 0.6)
                assert load_of(router, b.url) == (0.0, 0.1)
                st = scraper.status()
                assert st[a.url]["ok"] and not st[a.url]["stale"]
                assert st[a.url]["num_requests_running"] == 3.0
                assert st[a.url]["errors"] == 0 and st[a.url]["scrapes"] == 1
                assert 0 <= st[a.url]["age_s"] < 60

                a.metrics_text = vllm_metrics({0: (0, 9, 0.9)})
                await scraper.scrape_once()
                assert load_of(router, a.url) == (9.0, 0.9)
            finally:
                await scraper.aclose()

            counting = PrometheusScraper(router, {b.url: f"{b.url}/metrics"}, timeout_s=10,
                                         count_running=True)
            try:
                await counting.scrape_once()
                assert load_of(router, b.url) == (7.0, 0.1)
            finally:
                await counting.aclose()

    asyncio.run(main())


def test_malformed_metrics_and_http_errors_are_counted_not_raised(engines):
    good, bad = engines(), engines()
    good.metrics_text = vllm_metrics({0: (1, 2, 0.3)})
    bad.metrics_text = vllm_metrics({0: (1, 6, 0.7)})

    async def main():
        with Router([good.url, bad.url]) as router:
            async with httpx.AsyncClient(timeout=10) as client:
                scraper = PrometheusScraper(router, {good.url: f"{good.url}/metrics",
                                                     bad.url: f"{bad.url}/metrics"},
                                            client=client, timeout_s=10, stale_after_s=600)
                await scraper.scrape_once()
                assert load_of(router, bad.url) == (6.0, 0.7)

                bad.metrics_text = "<html>oops</html>\n"
                good.metrics_text = vllm_metrics({0: (1, 3, 0.4)})
                await scraper.scrape_once()
                st = scraper.status()[bad.url]
                assert not st["ok"] and st["errors"] == 1 and st["scrapes"] == 2
                assert "not a Prometheus text exposition" in st["last_error"]
                assert load_of(router, bad.url) == (6.0, 0.7)  # last good numbers kept
                assert load_of(router, good.url) == (3.0, 0.4)  # the other worker unaffected

                bad.metrics_status = 500
                bad.metrics_text = vllm_metrics({0: (0, 1, 0.1)})
                await scraper.scrape_once()
                assert "HTTP 500" in scraper.status()[bad.url]["last_error"]

                bad.metrics_status = 200  # recovers on the next good scrape
                await scraper.scrape_once()
                st = scraper.status()[bad.url]
                assert st["ok"] and st["last_error"] is None and st["errors"] == 2
                assert load_of(router, bad.url) == (1.0, 0.1)
                await scraper.aclose()
                assert not client.is_closed  # a caller's client is left open

    asyncio.run(main())


@pytest.mark.slow
def test_stale_load_is_cleared_when_the_engine_goes_away(engines):
    eng = engines()
    eng.metrics_text = vllm_metrics({0: (1, 8, 0.95)})
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def main():
        with Router([eng.url, dead]) as router:
            router.update_load(dead, num_requests_waiting=5, kv_cache_usage_perc=0.5)
            scraper = PrometheusScraper(router, {eng.url: f"{eng.url}/metrics",
                                                 dead: f"{dead}/metrics"},
                                        timeout_s=2, stale_after_s=2)
            try:
                await scraper.scrape_once()
                assert load_of(router, eng.url) == (8.0, 0.95)
                eng.stop()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not all(
                        s["stale"] for s in scraper.status().values()):
                    await scraper.scrape_once()
                    await asyncio.sleep(0.05)
                st = scraper.status()
                assert st[eng.url]["stale"] and not st[eng.url]["ok"]
                assert st[eng.url]["age_s"] > 2
                assert st[eng.url]["last_error"]
                # never scraped: stale once stale_after_s passed since it was added
                assert st[dead]["stale"] and st[dead]["age_s"] is None
                # the stale numbers no longer steer decisions
                assert load_of(router, eng.url) == (0.0, None)
                assert load_of(router, dead) == (0.0, None)
            finally:
                await scraper.aclose()

    asyncio.run(main())


@pytest.mark.slow
def test_a_malformed_target_url_does_not_stop_the_others_staleness(engines):
    # httpx.InvalidURL is not an httpx.HTTPError: it used to abort the whole round, so no
    # target's stale load was ever cleared.
    eng = engines()
    eng.metrics_text = vllm_metrics({0: (1, 8, 0.95)})
    bad = "http://b"

    async def main():
        with Router([eng.url, bad]) as router:
            scraper = PrometheusScraper(router, {eng.url: f"{eng.url}/metrics",
                                                 bad: "http://127.0.0.1:notaport/metrics"},
                                        timeout_s=2, stale_after_s=2)
            try:
                await scraper.scrape_once()  # does not raise
                assert load_of(router, eng.url) == (8.0, 0.95)
                st = scraper.status()[bad]
                assert not st["ok"] and st["errors"] == 1 and "InvalidURL" in st["last_error"]
                eng.stop()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not scraper.status()[eng.url]["stale"]:
                    await scraper.scrape_once()
                    await asyncio.sleep(0.05)
                assert scraper.status()[eng.url]["stale"]
                assert load_of(router, eng.url) == (0.0, None)
                assert scraper.status()[bad]["stale"] and scraper.rounds >= 2
            finally:
                await scraper.aclose()

    asyncio.run(main())


def test_aclose_does_not_swallow_the_callers_cancellation():
    async def main():
        with Router(["http://a"]) as router:
            scraper = PrometheusScraper(router, {}, interval_s=0.05)
            scraper.start()
            closer = asyncio.ensure_future(scraper.aclose())
            await asyncio.sleep(0)  # aclose has cancelled the loop and waits for it
            closer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closer
            assert not scraper.running
            await scraper.aclose()  # idempotent: closes the client
            assert scraper._client.is_closed

    asyncio.run(main())


def test_background_loop_targets_and_validation(engines):
    eng = engines()
    eng.metrics_text = vllm_metrics({0: (0, 2, 0.2)})

    async def main():
        with Router([eng.url, "http://b"]) as router:
            with pytest.raises(ValueError, match="interval_s must be a positive"):
                PrometheusScraper(router, {}, interval_s=0)
            async with PrometheusScraper(router, {}, interval_s=0.05, timeout_s=5) as scraper:
                assert scraper.running
                with pytest.raises(ValueError, match="must be http"):
                    scraper.add_target(eng.url, "tcp://x")
                with pytest.raises(KeyError, match="not a scrape target"):
                    scraper.remove_target("http://b")
                scraper.add_target(eng.url, f"{eng.url}/metrics")
                assert scraper.targets == {eng.url: f"{eng.url}/metrics"}
                await await_for(lambda: scraper.status()[eng.url]["scrapes"] >= 3,
                                "three scrapes", timeout=20, interval=0.02)
                assert load_of(router, eng.url) == (2.0, 0.2)
                scraper.remove_target(eng.url)
                assert scraper.status() == {}
            assert not scraper.running

    asyncio.run(main())
