"""Prefill/decode disaggregation: pools, policies and the uncached-token threshold."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvroute
import kvroute.wire as W
from kvroute import PDRouter

BS = 16
P = ["http://p0", "http://p1"]
D = ["http://d0", "http://d1", "http://d2"]


def store(router, worker, hashes, toks):
    assert router.ingest(worker, W.encode_batch([W.stored(hashes, None, list(toks), BS)]))


def test_pair_uses_each_pools_policy_and_releases_load():
    with PDRouter(P, D, seed=1) as pd:
        toks = list(range(10 * BS))
        store(pd.prefill, P[1], list(range(1, 11)), toks)
        a = pd.select_pair(toks + [1], session_key="s1")
        b = pd.select_pair(list(range(500, 600)), session_key="s1")
        assert a.prefill.worker == P[1] and a.prefill.policy == "kv_aware"
        assert a.decode.policy == "consistent_hash" and a.decode.worker == b.decode.worker
        assert not a.skipped_prefill
        pd.first_token(a)
        assert pd.stats()["prefill"]["workers"][P[1]]["inflight_requests"] == 0
        pd.complete(a)
        pd.complete(b)
        st = pd.stats()
        assert all(w["inflight_requests"] == 0 for pool in st.values()
                   for w in pool["workers"].values())


def test_threshold_skips_prefill_when_decode_worker_holds_the_prompt():
    with PDRouter(P, D, decode_policy="kv_aware", pd_uncached_token_threshold=32) as pd:
        toks = list(range(20 * BS))
        store(pd.decode, D[2], list(range(1, 21)), toks)
        near = pd.select_pair(toks + list(range(9000, 9000 + 30)))
        assert near.skipped_prefill and near.decode.worker == D[2]
        far = pd.select_pair(list(range(70000, 70000 + 10 * BS)))
        assert not far.skipped_prefill and far.prefill is not None


def test_bad_threshold_and_config():
    with pytest.raises(ValueError, match="pd_uncached_token_threshold"):
        PDRouter(P, D, pd_uncached_token_threshold=-1)
    pd = PDRouter.from_config(Path(__file__).resolve().parents[1] / "examples" / "router-pd.yaml",
                              pd_uncached_token_threshold=64)
    assert pd.prefill.workers and pd.decode.workers and pd.threshold == 64
    pd.close()
    assert "PDRouter" in kvroute.__all__
