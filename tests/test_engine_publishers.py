"""kvroute driven by the engines' own KV-event code: vLLM's and SGLang's publishers, event
structs and encoders, loaded from their PyPI wheels, over real ZeroMQ on 127.0.0.1.

The wheels are fetched once with ``pip download --no-deps`` into a cache outside the
repository (``$KVROUTE_ENGINE_CACHE``, default ``~/.cache/kvroute-engines``) and reused. Only
the KV-event modules are loaded, by path:

- vLLM: ``vllm/distributed/kv_events.py`` (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``, ``KVEventBatch``, ``ZmqEventPublisher``) and, from
  ``vllm/v1/core/kv_cache_utils.py``, the functions that make an event's hashes and extra keys
  (``hash_block_tokens``, ``generate_block_hash_extra_keys``, ``to_event_extra_keys``,
  ``maybe_convert_block_hash``), with ``vllm/utils/hashing.py``'s ``sha256``;
- SGLang: ``sglang/srt/disaggregation/kv_events.py`` (its structs and ``ZmqEventPublisher``).

Engine internals they import (logger, config decorator, network helpers, the parallel
state) are stubbed with the few names the modules use. `VllmEngine` plays vLLM's block pool
and KV-cache manager: it emits the events ``BlockPool.cache_full_blocks`` and
``KVCacheManager.take_events`` emit (parent hash, per-block extra keys, group index, spec
kind), built with vLLM's own functions. Tests skip only when PyPI cannot be reached.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import pytest
from _util import free_port, toks, wait_for

from kvroute import Router, Worker

VLLM_SPEC = os.environ.get("KVROUTE_VLLM_SPEC", "vllm==0.33.0")
SGLANG_SPEC = os.environ.get("KVROUTE_SGLANG_SPEC", "sglang==0.5.23")
CACHE = Path(os.environ.get("KVROUTE_ENGINE_CACHE", Path.home() / ".cache" / "kvroute-engines"))
BS = 16  # block size of every engine here


# -- fetching and loading the engines' modules ---------------------------------------------------

def _wheel(spec: str) -> Path:
    """The wheel of ``spec`` (``name==version``) in the cache, downloaded if missing."""
    name, _, version = spec.partition("==")
    CACHE.mkdir(parents=True, exist_ok=True)
    pattern = f"{name}-{version or '*'}-*.whl"
    found = sorted(CACHE.glob(pattern))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.11", "-d", str(CACHE), spec]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {spec} timed out: PyPI not reachable")
    found = sorted(CACHE.glob(pattern))
    if r.returncode != 0 or not found:
        pytest.skip(f"pip download {spec} failed (PyPI not reachable?): "
                    f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return found[-1]


def _extract(wheel: Path, members: Iterable[str]) -> Path:
    """Extracts ``members`` of ``wheel`` under the cache; returns the extraction root."""
    root = CACHE / ("src-" + wheel.stem)
    with zipfile.ZipFile(wheel) as z:
        for m in members:
            if not (root / m).exists():
                z.extract(m, root)
    return root


def _stub(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, so that submodules resolve
    mod.__dict__.update(attrs)
    return mod


def _load_by_path(name: str, path: Path, stubs: dict) -> types.ModuleType:
    """Executes the file at ``path`` as module ``name`` while ``stubs`` stand in
    ``sys.modules``; the stubs are taken out again afterwards."""
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    sys.modules[name] = mod
    try:
        exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    finally:
        del sys.modules[name]
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


def _functions(path: Path, names: Sequence[str], namespace: dict) -> dict:
    """The top-level functions ``names`` of the source file at ``path``, executed in
    ``namespace`` (annotations left unevaluated)."""
    tree = ast.parse(path.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in body}
    assert not missing, f"{path} no longer defines {sorted(missing)}"
    code = compile(ast.Module(body=body, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace


def _split_zmq_path(path: str) -> tuple:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host, port


@pytest.fixture(scope="module")
def vllm() -> SimpleNamespace:
    """vLLM's kv_events module (``.ev``) and its hashing helpers (``.utils``)."""
    wheel = _wheel(VLLM_SPEC)
    root = _extract(wheel, ["vllm/distributed/kv_events.py", "vllm/config/kv_events.py",
                            "vllm/v1/core/kv_cache_utils.py", "vllm/utils/hashing.py"])
    utils_ns = _functions(
        root / "vllm/v1/core/kv_cache_utils.py",
        ["hash_block_tokens", "maybe_convert_block_hash", "_gen_mm_extra_hash_keys",
         "_gen_lora_extra_hash_keys", "_gen_prompt_embeds_extra_hash_keys",
         "generate_block_hash_extra_keys", "to_event_extra_keys"],
        {"BlockHash": bytes, "NONE_HASH": b"\0" * 32,
         "envs": SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)})
    utils_ns.update(hashlib=hashlib, pickle=pickle)
    _functions(root / "vllm/utils/hashing.py", ["sha256"], utils_ns)
    utils = SimpleNamespace(**{k: v for k, v in utils_ns.items() if callable(v)})
    logger = _stub("vllm.logger", init_logger=logging.getLogger)
    config_utils = _stub("vllm.config.utils", config=lambda cls: __import__("dataclasses")
                         .dataclass(cls))
    base = {"vllm": _stub("vllm"), "vllm.config": _stub("vllm.config"),
            "vllm.config.utils": config_utils, "vllm.logger": logger}
    cfg = _load_by_path("vllm.config.kv_events", root / "vllm/config/kv_events.py", base)
    stubs = dict(base)
    stubs.update({
        "vllm.config.kv_events": cfg,
        "vllm.utils": _stub("vllm.utils"),
        "vllm.utils.network_utils": _stub(
            "vllm.utils.network_utils", get_ip=lambda: "127.0.0.1",
            get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
            is_valid_ipv6_address=lambda ip: False, split_zmq_path=_split_zmq_path),
        "vllm.v1": _stub("vllm.v1"), "vllm.v1.core": _stub("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": _stub("vllm.v1.core.kv_cache_utils",
                                             ExternalBlockHash=bytes | int),
    })
    ev = _load_by_path("vllm.distributed.kv_events", root / "vllm/distributed/kv_events.py",
                       stubs)
    logging.getLogger(ev.__name__).setLevel(logging.ERROR)  # its shutdown's drain warning
    return SimpleNamespace(ev=ev, utils=utils, version=wheel.name.split("-")[1])


@pytest.fixture(scope="module")
def sglang() -> SimpleNamespace:
    """SGLang's kv_events module (structs and ZMQ publisher)."""
    wheel = _wheel(SGLANG_SPEC)
    root = _extract(wheel, ["sglang/srt/disaggregation/kv_events.py"])
    parallel = SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=1,
                               attn_dp_rank=0, dp_rank=0)
    stubs = {"sglang": _stub("sglang"), "sglang.srt": _stub("sglang.srt"),
             "sglang.srt.runtime_context": _stub("sglang.srt.runtime_context",
                                                 get_parallel=lambda: parallel),
             "sglang.srt.utils": _stub("sglang.srt.utils"),
             "sglang.srt.utils.network": _stub("sglang.srt.utils.network",
                                               NetworkAddress=object)}
    ev = _load_by_path("sglang.srt.disaggregation.kv_events",
                       root / "sglang/srt/disaggregation/kv_events.py", stubs)
    logging.getLogger(ev.__name__).setLevel(logging.ERROR)  # its shutdown's drain warning
    return SimpleNamespace(ev=ev, version=wheel.name.split("-")[1])


# -- engine stand-ins built on the engines' own code ----------------------------------------------

class VllmEngine:
    """vLLM's event side of one engine: a ``ZmqEventPublisher`` and the events vLLM's block
    pool emits, built with vLLM's functions. ``groups`` are the KV-cache groups' spec kinds
    (``KVCacheManager.kv_cache_event_metadata``); every group caches every full block, as a
    hybrid model's groups do when none masks blocks out."""

    def __init__(self, vllm: SimpleNamespace, *, endpoint: str = "tcp://*:0",
                 replay: bool = True, dp_rank: int = 0,
                 groups: Sequence[tuple] = (("full_attention", None),)) -> None:
        self.v = vllm
        self.groups = list(groups)
        self.pub = vllm.ev.ZmqEventPublisher(
            dp_rank, endpoint=endpoint,
            replay_endpoint="tcp://127.0.0.1:0" if replay else None)
        cfg = self.pub.get_publisher_config()
        self.endpoint, self.replay_endpoint = cfg.endpoint, cfg.replay_endpoint
        if replay:  # the ROUTER bound port 0: ask the socket which port it got
            self.replay_endpoint = self.pub._replay.getsockopt_string(
                __import__("zmq").LAST_ENDPOINT)
        self.published = 0

    def request(self, tokens: Sequence[int], *, lora: Optional[str] = None,
                salt: Optional[str] = None) -> SimpleNamespace:
        lora_request = None if lora is None else SimpleNamespace(
            lora_name=lora, name=lora, lora_path=f"/adapters/{lora}", adapter_id=7)
        return SimpleNamespace(all_token_ids=list(tokens), lora_request=lora_request,
                               cache_salt=salt, mm_features=[], prompt_embeds=None)

    def hashes(self, req: SimpleNamespace) -> list:
        """vLLM's block hashes of the request's full blocks (``Request.block_hashes``)."""
        u, out, parent = self.v.utils, [], None
        for i in range(len(req.all_token_ids) // BS):
            extra, _ = u.generate_block_hash_extra_keys(req, i * BS, (i + 1) * BS, 0)
            parent = u.hash_block_tokens(u.sha256, parent,
                                         req.all_token_ids[i * BS:(i + 1) * BS], extra)
            out.append(parent)
        return out

    def stored(self, req: SimpleNamespace, start: int, end: int, group: int = 0) -> Any:
        """The BlockStored ``cache_full_blocks`` emits for blocks [start, end) of one group,
        annotated as ``KVCacheManager.take_events`` does."""
        u, ev = self.v.utils, self.v.ev
        hs = self.hashes(req)
        extras = [u.generate_block_hash_extra_keys(req, i * BS, (i + 1) * BS, 0)[0]
                  for i in range(start, end)]
        lr = req.lora_request
        e = ev.BlockStored(
            block_hashes=[u.maybe_convert_block_hash(h) for h in hs[start:end]],
            parent_block_hash=None if start == 0 else u.maybe_convert_block_hash(hs[start - 1]),
            token_ids=req.all_token_ids[start * BS:end * BS], block_size=BS,
            lora_id=lr.adapter_id if lr else None, medium="GPU",
            lora_name=lr.name if lr else None, extra_keys=u.to_event_extra_keys(extras),
            group_idx=group, session_id=getattr(req, "session_id", None),
            lookahead_token_ids=getattr(req, "lookahead", None))
        e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window = self.groups[group]
        return e

    def removed(self, req: SimpleNamespace, blocks: Iterable[int], group: int = 0) -> list:
        """The BlockRemoved events ``_emit_block_removed_events`` sends (one per hash)."""
        u, hs = self.v.utils, self.hashes(req)
        return [self.v.ev.BlockRemoved(block_hashes=[u.maybe_convert_block_hash(hs[i])],
                                       medium="GPU", group_idx=group) for i in blocks]

    def compute(self, req: SimpleNamespace) -> None:
        """Caches the request's full blocks in every group, in one scheduler step."""
        n = len(req.all_token_ids) // BS
        self.publish([self.stored(req, 0, n, g) for g in range(len(self.groups))])

    def publish(self, events: list) -> None:
        self.pub.publish(self.v.ev.KVEventBatch(ts=time.time(), events=events))
        self.published += 1

    def close(self) -> None:
        # vLLM's shutdown stops the thread before it takes the stop sentinel, then waits
        # SHUTDOWN_TIMEOUT (1 s) for the queue to drain; the thread itself ends within its
        # 0.1 s poll, so a shorter wait loses nothing.
        self.pub.SHUTDOWN_TIMEOUT = 0.3
        self.pub.shutdown()


@pytest.fixture
def engines() -> Iterator[Callable[..., Any]]:
    made: list = []

    def make(cls: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        made.append(cls(*a, **kw))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.fixture
def routers() -> Iterator[Callable[..., Router]]:
    made: list = []

    def make(workers: list, **kw: Any) -> Router:
        kw.setdefault("block_size", BS)
        made.append(Router(workers, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def matched(router: Router, tokens: Sequence[int], **kw: Any) -> dict:
    return {w: m.tokens for w, m in router.find_matches(tokens, **kw).items()}


def subscribed(router: Router, name: str, engine: Any, probe: Sequence[int],
               **kw: Any) -> None:
    """Publishes ``probe`` until the router's socket is joined (ZeroMQ's slow joiner) and
    the probe is matched."""
    def seen() -> bool:
        engine.compute(engine.request(probe, **kw))
        try:
            wait_for(lambda: matched(router, probe, **kw)[name] == len(probe), timeout=0.3)
        except AssertionError:
            return False
        return True
    wait_for(seen, f"{name} subscribed", interval=0)


def stats(router: Router, name: str) -> dict:
    return router.stats()["workers"][name]


def caught_up(router: Router, name: str, engine: VllmEngine) -> None:
    """Waits until the router applied every batch the engine published."""
    wait_for(lambda: stats(router, name)["last_seq"] == engine.published - 1,
             f"{name} caught up", info=lambda: stats(router, name))


# -- vLLM ---------------------------------------------------------------------------------------

def test_vllm_plain_prefix_store_and_remove(vllm, engines, routers):
    eng = engines(VllmEngine, vllm)
    r = routers([Worker("w0", eng.endpoint, replay_endpoint=eng.replay_endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    req = eng.request(toks(128))
    eng.compute(req)
    wait_for(lambda: matched(r, toks(128 + 5))["w0"] == 128, "prefix of 8 blocks")
    eng.publish(eng.removed(req, [5, 6, 7]))
    wait_for(lambda: matched(r, toks(128))["w0"] == 80, "blocks 5-7 removed")
    eng.publish([vllm.ev.AllBlocksCleared()])
    wait_for(lambda: matched(r, toks(128))["w0"] == 0, "cleared")
    # Fields kvroute does not read (vLLM 0.33.0's session_id, ownership, lookahead tokens) are
    # skipped.
    req = eng.request(toks(64))
    req.session_id, req.lookahead = "session-1", [[7, 8]] * 4
    ev = eng.stored(req, 0, 4)
    ev.ownership = "tier-b"
    eng.publish([ev])
    wait_for(lambda: matched(r, toks(64))["w0"] == 64, "stored with the fields kvroute skips")
    assert sum(stats(r, "w0")["dropped"].values()) == 0


def test_vllm_connects_when_endpoint_is_not_a_wildcard(vllm, engines, routers):
    """vLLM binds only wildcard / ipc / inproc endpoints; to tcp://127.0.0.1:N it connects,
    so the router's SUB socket binds (``Worker(bind=True)``)."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    r = routers([Worker("w0", ep, bind=True)])
    eng = engines(VllmEngine, vllm, endpoint=ep, replay=False)
    subscribed(r, "w0", eng, toks(32, 90_000))
    eng.compute(eng.request(toks(64)))
    wait_for(lambda: matched(r, toks(64))["w0"] == 64, "matched through a connecting PUB")


def test_vllm_cache_salt(vllm, engines, routers):
    eng = engines(VllmEngine, vllm)
    r = routers([Worker("w0", eng.endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    eng.compute(eng.request(toks(64), salt="tenant-a"))
    wait_for(lambda: matched(r, toks(64), cache_salt="tenant-a")["w0"] == 64, "salted prefix")
    assert matched(r, toks(64))["w0"] == 0
    assert matched(r, toks(64), cache_salt="tenant-b")["w0"] == 0


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_vllm_lora(vllm, engines, routers, salt):
    """vLLM names the adapter in ``lora_name`` and as the first extra key of every block
    (``(name, salt)`` on the first block of a salted request); kvroute matches a request
    for that adapter (and salt), and nothing else."""
    eng = engines(VllmEngine, vllm)
    r = routers([Worker("w0", eng.endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    req = eng.request(toks(96), lora="sql-adapter", salt=salt)
    stored = eng.stored(req, 0, 6)
    assert stored.extra_keys[0] == (("sql-adapter", salt) if salt else ("sql-adapter",))
    eng.publish([stored])
    kw = {"cache_salt": salt} if salt else {}
    wait_for(lambda: matched(r, toks(96), lora_name="sql-adapter", **kw)["w0"] == 96,
             "LoRA prefix matched", info=lambda: stats(r, "w0"))
    assert matched(r, toks(96), **kw)["w0"] == 0
    assert matched(r, toks(96), lora_name="other", **kw)["w0"] == 0
    # A continuation of the same request (parent = the last block) chains on.
    req2 = eng.request(toks(128), lora="sql-adapter", salt=salt)
    eng.publish([eng.stored(req2, 6, 8)])
    wait_for(lambda: matched(r, toks(128), lora_name="sql-adapter", **kw)["w0"] == 128,
             "continuation matched")


def test_vllm_mla_is_full_attention(vllm, engines, routers):
    """DeepSeek-style models' groups are ``mla_attention`` (an ``MLAAttentionSpec``, a
    ``FullAttentionSpec`` in vLLM): indexed as full attention."""
    eng = engines(VllmEngine, vllm, groups=[("mla_attention", None)])
    r = routers([Worker("w0", eng.endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    eng.compute(eng.request(toks(64)))
    wait_for(lambda: matched(r, toks(64))["w0"] == 64, "MLA blocks matched")
    assert stats(r, "w0")["dropped"].get("unsupported_spec", 0) == 0


def test_vllm_hybrid_groups(vllm, engines, routers):
    """A hybrid model (gpt-oss / Gemma 3 style): group 0 full attention, group 1 sliding
    window, the same block hashes in both. The sliding-window group is not indexed (its
    stores and removes are counted as ``unsupported_spec``), and its removes leave the
    full-attention blocks indexed."""
    eng = engines(VllmEngine, vllm,
                  groups=[("full_attention", None), ("sliding_window", 128)])
    r = routers([Worker("w0", eng.endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    req = eng.request(toks(128))
    eng.compute(req)
    wait_for(lambda: matched(r, toks(128))["w0"] == 128, "full-attention blocks matched")
    eng.publish(eng.removed(req, range(8), group=1))  # the window slides past them
    caught_up(r, "w0", eng)
    assert matched(r, toks(128))["w0"] == 128
    eng.publish(eng.removed(req, range(4, 8), group=0))  # full attention evicts its tail
    wait_for(lambda: matched(r, toks(128))["w0"] == 64, "full-attention removes applied")


def test_vllm_report_mode_full_reports_do_not_keep_evicted_blocks(vllm, engines, routers):
    """With ``kv_cache_report_mode="full"`` vLLM re-sends a prefix-cache hit as a BlockStored
    of the hit blocks from token 0 (``BlockPool.emit_cached_block_events``, the same event
    ``_build_block_stored_event`` builds), and evicts each block once. Every evicted block
    leaves the index; the re-reported blocks stay as held as before."""
    eng = engines(VllmEngine, vllm)
    r = routers([Worker("w0", eng.endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    req = eng.request(toks(128))
    eng.compute(req)
    for _ in range(3):  # three later requests hit the whole prefix
        eng.publish([eng.stored(eng.request(toks(128 + 7)), 0, 8)])
    caught_up(r, "w0", eng)
    assert matched(r, toks(128))["w0"] == 128
    eng.publish(eng.removed(req, range(4, 8)))
    wait_for(lambda: matched(r, toks(128))["w0"] == 64, "evicted blocks gone",
             info=lambda: (stats(r, "w0"), r.worker_blocks("w0")))
    assert stats(r, "w0")["unknown_removes"] == 0


def test_vllm_multimodal_extra_keys(vllm, engines, routers):
    """A multimodal request: every block an image overlaps carries ``(mm_identifier, offset
    of the image from the block's start)`` among its extra keys (vLLM
    ``_gen_mm_extra_hash_keys``; published as ``[identifier, offset]``). A server passes the
    same per-block lists as ``select_worker(..., extra_keys=...)``: ``None`` for a block
    without, ``[[identifier, offset]]`` for a block with one image."""
    eng = engines(VllmEngine, vllm)
    r = routers([Worker("w0", eng.endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    req = eng.request(toks(96))
    image = SimpleNamespace(identifier="sha256:1f0e", mm_position=SimpleNamespace(offset=20,
                                                                                 length=40))
    req.mm_features = [image]
    eng.publish([eng.stored(req, 0, 6)])
    extra = [None] + [[[image.identifier, 20 - b * BS]] for b in (1, 2, 3)] + [None, None]
    wait_for(lambda: matched(r, toks(96), extra_keys=extra)["w0"] == 96, "image blocks matched",
             info=lambda: stats(r, "w0"))
    assert matched(r, toks(96))["w0"] == BS  # text only: the first block, without the image
    other = [None] + [[["sha256:other", 20 - b * BS]] for b in (1, 2, 3)] + [None, None]
    assert matched(r, toks(96), extra_keys=other)["w0"] == BS
    # With a LoRA adapter as well: the adapter name leads each block's extra keys.
    lreq = eng.request(toks(96, 4000), lora="vision-adapter")
    lreq.mm_features = [image]
    eng.publish([eng.stored(lreq, 0, 6)])
    wait_for(lambda: matched(r, toks(96, 4000), lora_name="vision-adapter",
                             extra_keys=extra)["w0"] == 96, "LoRA + image blocks matched")


def test_vllm_dp_ranks(vllm, engines, routers):
    """Each data-parallel rank runs its own publisher (port + rank; port 0 stays 0) and
    stamps its batches with its rank."""
    e0 = engines(VllmEngine, vllm, dp_rank=0)
    e1 = engines(VllmEngine, vllm, dp_rank=1)
    r = routers([Worker("http://e", e0.endpoint, dp_rank=0),
                 Worker("http://e", e1.endpoint, dp_rank=1)])
    subscribed(r, "http://e|dp=0", e0, toks(32, 90_000))
    subscribed(r, "http://e|dp=1", e1, toks(32, 80_000))
    e0.compute(e0.request(toks(64)))
    e1.compute(e1.request(toks(96, 5_000)))
    wait_for(lambda: matched(r, toks(64))["http://e|dp=0"] == 64, "rank 0")
    wait_for(lambda: matched(r, toks(96, 5_000))["http://e|dp=1"] == 96, "rank 1")
    assert matched(r, toks(64))["http://e|dp=1"] == 0
    assert matched(r, toks(96, 5_000))["http://e|dp=0"] == 0


def test_vllm_late_join_is_filled_from_its_replay_socket(vllm, engines, routers):
    """Batches published before the router joined are a real gap (seq 0..k lost to the
    slow joiner); the router fills it from vLLM's own replay ROUTER socket."""
    eng = engines(VllmEngine, vllm)
    for i in range(4):
        eng.compute(eng.request(toks(64, 1000 * i)))
    time.sleep(0.3)  # the publisher thread has sent them (to nobody)
    r = routers([Worker("w0", eng.endpoint, replay_endpoint=eng.replay_endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    for i in range(4):
        wait_for(lambda i=i: matched(r, toks(64, 1000 * i))["w0"] == 64, f"batch {i} replayed",
                 info=lambda: stats(r, "w0"))
    s = stats(r, "w0")
    assert s["replays"] >= 1 and s["state"] == "exact"


def test_vllm_restart_clears_the_old_index(vllm, engines, routers):
    """A restarted engine publishes from seq 0 again on the same endpoint: the worker's
    blocks from before the restart go."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    r = routers([Worker("w0", ep, bind=True)])
    eng = engines(VllmEngine, vllm, endpoint=ep, replay=False)
    subscribed(r, "w0", eng, toks(32, 90_000))
    for i in range(3):
        eng.compute(eng.request(toks(64, 1000 * i)))
    wait_for(lambda: matched(r, toks(64, 2000))["w0"] == 64, "before the restart")
    eng.close()
    eng2 = engines(VllmEngine, vllm, endpoint=ep, replay=False)
    subscribed(r, "w0", eng2, toks(32, 70_000))
    wait_for(lambda: matched(r, toks(64))["w0"] == 0, "old blocks gone",
             info=lambda: stats(r, "w0"))
    assert stats(r, "w0")["resets"] >= 1


# -- SGLang -------------------------------------------------------------------------------------

class SglangEngine:
    """SGLang's event side: its ``ZmqEventPublisher`` and its ``BlockStored`` structs, one
    event per radix-tree page (SGLang's page size = block size), block hashes as SGLang's
    radix cache gives them (opaque int64s)."""

    def __init__(self, sglang: SimpleNamespace, *, dp_rank: int = 0, replay: bool = True,
                 page_size: int = BS) -> None:
        import zmq
        self.s, self.page = sglang, page_size
        # SGLang offsets every port by the rank, port 0 included: base ports that land on
        # free ones.
        pub_port, replay_port = free_port() - dp_rank, free_port() - dp_rank
        self.pub = sglang.ev.ZmqEventPublisher(
            dp_rank, endpoint=f"tcp://127.0.0.1:{pub_port}", bind=True,
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}" if replay else None)
        self.endpoint = self.pub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (self.pub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                                if replay else None)

    def request(self, tokens: Sequence[int], *, lora: Optional[str] = None,
                salt: Optional[str] = None) -> SimpleNamespace:
        return SimpleNamespace(tokens=list(tokens), lora=lora, salt=salt)

    def hashes(self, req: SimpleNamespace) -> list:
        seed = self.s.ev.kv_event_namespace_seed(extra_key=req.lora, cache_salt=req.salt)
        out, p = [], self.page
        for i in range(len(req.tokens) // p):
            h = hash((req.lora, req.salt, tuple(req.tokens[:(i + 1) * p]))) & (2**63 - 1)
            out.append(self.s.ev.namespaced_block_hash(h, namespace_seed=seed))
        return out

    def compute(self, req: SimpleNamespace, medium: str = "GPU") -> None:
        hs, events, p = self.hashes(req), [], self.page
        for i, h in enumerate(hs):
            events.append(self.s.ev.BlockStored(
                block_hashes=[h], parent_block_hash=hs[i - 1] if i else None,
                token_ids=req.tokens[i * p:(i + 1) * p], block_size=p, lora_id=None,
                medium=medium, cache_salt=req.salt, lora_name=req.lora))
        self.publish(events)

    def removed(self, req: SimpleNamespace, blocks: Iterable[int], medium: str = "GPU") -> list:
        hs = self.hashes(req)
        return [self.s.ev.BlockRemoved(block_hashes=[hs[i]], medium=medium) for i in blocks]

    def publish(self, events: list) -> None:
        self.pub.publish(self.s.ev.KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        self.pub.SHUTDOWN_TIMEOUT = 0.3  # as VllmEngine.close: the same shutdown
        self.pub.shutdown()


def test_sglang_prefix_salt_lora_and_remove(sglang, engines, routers):
    eng = engines(SglangEngine, sglang)
    r = routers([Worker("w0", eng.endpoint, replay_endpoint=eng.replay_endpoint)])
    subscribed(r, "w0", eng, toks(32, 90_000))
    plain = eng.request(toks(96))
    eng.compute(plain)
    eng.compute(eng.request(toks(64, 3000), salt="tenant-a"))
    eng.compute(eng.request(toks(64, 6000), lora="sql-adapter"))
    wait_for(lambda: matched(r, toks(96))["w0"] == 96, "plain prefix")
    wait_for(lambda: matched(r, toks(64, 3000), cache_salt="tenant-a")["w0"] == 64, "salted")
    wait_for(lambda: matched(r, toks(64, 6000), lora_name="sql-adapter")["w0"] == 64, "LoRA")
    assert matched(r, toks(64, 3000))["w0"] == 0
    assert matched(r, toks(64, 6000))["w0"] == 0
    eng.publish(eng.removed(plain, [4, 5]))
    wait_for(lambda: matched(r, toks(96))["w0"] == 64, "tail removed")
    assert sum(stats(r, "w0")["dropped"].values()) == 0


def test_sglang_dp_ranks_and_late_join(sglang, engines, routers):
    e0 = engines(SglangEngine, sglang, dp_rank=0)
    e1 = engines(SglangEngine, sglang, dp_rank=1)
    e1.compute(e1.request(toks(64, 5000)))  # before the router joins: replayed
    time.sleep(0.3)
    r = routers([Worker("http://s", e0.endpoint, dp_rank=0),
                 Worker("http://s", e1.endpoint, dp_rank=1,
                        replay_endpoint=e1.replay_endpoint)])
    subscribed(r, "http://s|dp=0", e0, toks(32, 90_000))
    subscribed(r, "http://s|dp=1", e1, toks(32, 80_000))
    e0.compute(e0.request(toks(64)))
    wait_for(lambda: matched(r, toks(64))["http://s|dp=0"] == 64, "rank 0")
    wait_for(lambda: matched(r, toks(64, 5000))["http://s|dp=1"] == 64, "rank 1 replayed")
    assert matched(r, toks(64))["http://s|dp=1"] == 0


# -- restarts the sequence numbers do not show ---------------------------------------------------
# Two restarts show neither a backward sequence nor a changed replayed batch; the router sees
# them on the connection (the SUB socket's monitor: a publisher connection made again after
# one was lost is treated as a restart unless replay verifies it; cpp/events/README.md).

RESTART_BOUND_S = 3.0  # how long the index may go on claiming a restarted engine's old blocks


def _vllm_engine_that_stops(vllm, engines, routers):
    """A router bound on a fresh endpoint, a vLLM engine (its own publisher, no replay)
    connected to it holding a 64-token prefix the router has indexed, then stopped. Returns
    (router, endpoint, the last sequence number applied)."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    r = routers([Worker("w0", ep, bind=True)])
    eng = engines(VllmEngine, vllm, endpoint=ep, replay=False)
    subscribed(r, "w0", eng, toks(32, 90_000))
    eng.compute(eng.request(toks(64)))
    caught_up(r, "w0", eng)
    last = stats(r, "w0")["last_seq"]
    eng.close()
    return r, ep, last


@pytest.mark.slow
def test_vllm_restart_seen_when_its_first_seq_follows_the_old_last(vllm, engines, routers):
    import itertools
    r, ep, last = _vllm_engine_that_stops(vllm, engines, routers)
    eng2 = engines(VllmEngine, vllm, endpoint=ep, replay=False)
    # The new process's batches 0..last went out before the router's socket joined it.
    eng2.pub._seq_gen = itertools.count(last + 1)
    eng2.published = last + 1
    subscribed(r, "w0", eng2, toks(32, 70_000))
    wait_for(lambda: matched(r, toks(64))["w0"] == 0, "the old engine's blocks gone",
             timeout=RESTART_BOUND_S)


@pytest.mark.slow
def test_vllm_restart_seen_before_the_new_engine_publishes(vllm, engines, routers):
    r, ep, _ = _vllm_engine_that_stops(vllm, engines, routers)
    engines(VllmEngine, vllm, endpoint=ep, replay=False)  # up, idle: no event yet
    wait_for(lambda: matched(r, toks(64))["w0"] == 0, "the old engine's blocks gone",
             timeout=RESTART_BOUND_S)


def test_sglang_page_size_and_tiers(sglang, engines, routers):
    """SGLang with pages of 64 tokens (``--page-size 64``; the router's block size) and its
    hierarchical cache: a page written back to host memory is stored again with medium
    ``CPU_PINNED`` (``StorageMedium.CPU``), its GPU copy removed; the match credits the CPU
    tier's weight."""
    eng = engines(SglangEngine, sglang, page_size=64)
    r = routers([Worker("w0", eng.endpoint)], block_size=64)
    subscribed(r, "w0", eng, toks(64, 90_000))
    req = eng.request(toks(256))
    eng.compute(req)
    wait_for(lambda: matched(r, toks(256 + 30))["w0"] == 256, "pages of 64")
    eng.compute(req, medium=sglang.ev.StorageMedium.CPU.value)
    eng.publish(eng.removed(req, range(4)))
    wait_for(lambda: r.find_matches(toks(256))["w0"].weighted_tokens == pytest.approx(256 * 0.8),
             "held on the CPU tier only", info=lambda: stats(r, "w0"))
    eng.publish(eng.removed(req, [3], medium=sglang.ev.StorageMedium.CPU.value))
    wait_for(lambda: matched(r, toks(256))["w0"] == 192, "a CPU page evicted")
    assert stats(r, "w0")["unknown_medium"] == 0
