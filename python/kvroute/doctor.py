"""`kvroute doctor`: checks that the router will see what each engine caches, engine by engine,
and says what to change when it will not.

The silent failure of KV-aware routing is a router that believes it routes on cache while the
engines hit nothing: a chat template applied differently, a block size that differs, a
publisher bound where the router also binds, events that never arrive. Each check below
catches one of them, against the live engines of a configuration:

==============  ===========================================================================
check           how
==============  ===========================================================================
topology        the configuration alone: a wildcard address the router would connect to,
                two workers on one endpoint and rank, a bound address that is not local
reachable       ``GET <url>/v1/models`` answers 200 (and names the configured model)
events          a SUB socket of its own on the worker's ``kv_events`` (connected or bound as
                configured, same topic) sees a batch after a probe request: a completions
                request with fresh random token ids (``max_tokens: 1``) sent to the engine
block_size      the probe's BlockStored token counts per block (``len(token_ids) /
                len(block_hashes)``) equal the router's ``block_size``
stored_tokens   the probe's BlockStored token ids equal the probe prompt's full blocks, so
                the engine's blocks get the router's block keys (``kvroute.block_keys``)
dp_rank         the batches' ``data_parallel_rank`` equals the worker's ``dp_rank``
clock           the batches' ``ts`` is within ``max_skew_s`` of this host's clock
replay          the ``replay`` ROUTER answers a replay request (vLLM's wire: ``["", seq8]``)
tokenization    the router's tokenizer and chat template give the engine's own ``POST
                /tokenize`` token ids for a completions prompt and a chat
==============  ===========================================================================

Every check gives ``ok``, ``warn``, ``fail`` or ``skip`` (it could not run: an earlier one
failed, or the engine has no such route), a detail and, when not ``ok``, what to change.
`run` runs them; `format_report` prints them; `exit_code` is 1 when any failed.

``kvroute serve`` runs the same checks at start-up and logs the failures as warnings
(``--no-doctor`` skips them).
"""

from __future__ import annotations

import ipaddress
import random
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Check", "check_stored", "check_topology", "exit_code", "format_report", "run"]

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"

#: Sample prompts for the tokenization check (a completions prompt and a chat).
SAMPLE_PROMPT = "The quick brown fox jumps over the lazy dog. Tokenizers disagree on edges: ½ → ∞"
SAMPLE_CHAT = [{"role": "system", "content": "You are a careful assistant."},
               {"role": "user", "content": "Summarise the plot of Hamlet in two sentences."}]

_REPLAY_END = 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True)
class Check:
    """One check of one worker: ``status`` is ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"``;
    ``fix`` says what to change (``None`` when ok)."""

    worker: str
    name: str
    status: str
    detail: str
    fix: Optional[str] = None

    def as_dict(self) -> Dict[str, Any]:
        return {"worker": self.worker, "check": self.name, "status": self.status,
                "detail": self.detail, "fix": self.fix}


# -- static checks ------------------------------------------------------------------------------

def _host_of(endpoint: str) -> Optional[str]:
    """The host of a ``tcp://host:port`` endpoint (brackets stripped), else None."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://"):]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def _is_wildcard(host: Optional[str]) -> bool:
    return host in ("*", "0.0.0.0", "::", "")


def _is_local(host: str) -> bool:
    if _is_wildcard(host) or host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return False
    if ip.is_loopback:
        return True
    try:
        with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                           socket.SOCK_DGRAM) as s:
            s.bind((str(ip), 0))
        return True
    except OSError:
        return False


def check_topology(workers: Sequence[Any]) -> List[Check]:
    """The configuration-only checks: per worker (`kvroute.Worker`), ``topology``."""
    out: List[Check] = []
    seen: Dict[Tuple[str, Optional[int]], str] = {}
    for w in workers:
        ep = w.kv_endpoint
        if not ep:
            out.append(Check(w.name, "topology", WARN, "no kv_events endpoint: the router "
                             "sees none of this engine's cache (it routes on load alone)",
                             "add kv_events: the engine's --kv-events-config endpoint, with "
                             "its host (e.g. tcp://engine-host:5557)"))
            continue
        host = _host_of(ep)
        problems: List[Tuple[str, str]] = []
        if not w.bind and _is_wildcard(host):
            problems.append((f"kv_events {ep} is a bind address; the router connects to it",
                             f"give the engine's host: tcp://<engine-host>:{ep.rsplit(':', 1)[-1]} "
                             "(vLLM binds a wildcard endpoint), or set bind: true if the engine "
                             "connects to the router"))
        if w.bind and host is not None and not _is_local(host):
            problems.append((f"bind: true, but {host} is not an address of this host",
                             "bind an address of the router's host (e.g. tcp://0.0.0.0:<port>) "
                             "and point the engine's endpoint at it, or set bind: false and "
                             "give the engine's own bound endpoint"))
        key = (ep, w.dp_rank)
        if key in seen:
            problems.append((f"kv_events {ep} is also {seen[key]}'s",
                             "give each engine (and each data-parallel rank: port + rank) its "
                             "own endpoint"))
        seen.setdefault(key, w.name)
        if problems:
            out.append(Check(w.name, "topology", FAIL, "; ".join(p[0] for p in problems),
                             "; ".join(p[1] for p in problems)))
        else:
            out.append(Check(w.name, "topology", OK,
                             f"{'binds' if w.bind else 'connects to'} {ep}"))
    return out


# -- checks over collected events ----------------------------------------------------------------

def check_stored(worker: str, probe: Sequence[int], batches: Sequence[Mapping[str, Any]],
                 *, block_size: int, dp_rank: Optional[int], recv_times: Sequence[float],
                 max_skew_s: float = 2.0) -> List[Check]:
    """``block_size``, ``stored_tokens``, ``dp_rank`` and ``clock`` from the decoded batches
    (`kvroute.decode_batch` shape) that arrived after the probe, with their arrival times
    (Unix seconds, one per batch)."""
    out: List[Check] = []
    stores = [ev for b in batches for ev in b.get("events", ())
              if ev.get("type") == "BlockStored" and ev.get("block_hashes")]
    sizes = sorted({len(ev.get("token_ids") or ()) // len(ev["block_hashes"]) for ev in stores
                    if ev.get("token_ids")})
    if not sizes:
        out.append(Check(worker, "block_size", SKIP, "no BlockStored with token ids arrived"))
    elif sizes != [block_size]:
        eng = sizes[0] if len(sizes) == 1 else sizes
        out.append(Check(worker, "block_size", FAIL,
                         f"the engine stores {eng} tokens per block, the router's block_size "
                         f"is {block_size} (its BlockStored are dropped as block_size_mismatch)",
                         f"set block_size: {eng} in the router config (or start the engine "
                         f"with --block-size {block_size}; SGLang: --page-size)"))
    else:
        out.append(Check(worker, "block_size", OK, f"{block_size} tokens per block"))

    # The probe's blocks: the stores whose tokens come from the probe (the first full blocks).
    stored: List[int] = []
    for ev in stores:
        toks = list(ev.get("token_ids") or ())
        if ev.get("parent_block_hash") is None and toks:
            stored = toks  # the run from token 0
        elif stored and toks:
            stored += toks
    n_full = len(probe) // block_size * block_size
    want = list(probe[:n_full])
    if not stores:
        out.append(Check(worker, "stored_tokens", SKIP, "no BlockStored arrived"))
    elif stored[:n_full] == want and len(stored) >= n_full:
        out.append(Check(worker, "stored_tokens", OK,
                         f"the probe's {n_full // block_size} blocks stored with its token ids"))
    else:
        i = next((k for k, (a, b) in enumerate(zip(stored, want)) if a != b),
                 min(len(stored), len(want)))
        out.append(Check(worker, "stored_tokens", FAIL,
                         f"the engine's BlockStored token ids differ from the prompt sent from "
                         f"position {i} (sent {want[i:i + 4]}, stored {stored[i:i + 4]}; "
                         f"{len(stored)} tokens stored, {n_full} expected)",
                         "the engine changes token-id prompts (an added BOS, a LoRA or "
                         "multimodal prefix) or keys blocks with extra keys the router does "
                         "not pass: route with the same lora_name / cache_salt / extra_keys, "
                         "and check the engine's --block-size"))

    ranks = sorted({b.get("data_parallel_rank") for b in batches}, key=lambda r: (r is None, r))
    if not batches:
        out.append(Check(worker, "dp_rank", SKIP, "no batch arrived"))
    elif dp_rank is not None and ranks != [dp_rank]:
        out.append(Check(worker, "dp_rank", FAIL,
                         f"the endpoint publishes rank {ranks}, the worker expects dp_rank "
                         f"{dp_rank} (its batches are dropped as rank_mismatch)",
                         f"set dp_rank to the rank this endpoint publishes, or the endpoint to "
                         f"the engine's port + {dp_rank} (rank r publishes on port + r)"))
    elif dp_rank is None and len([r for r in ranks if r is not None]) > 1:
        out.append(Check(worker, "dp_rank", FAIL,
                         f"one endpoint publishes ranks {ranks}",
                         "one worker entry per rank, each with its dp_rank"))
    else:
        out.append(Check(worker, "dp_rank", OK, f"rank {ranks[0] if ranks else None}"
                         + ("" if dp_rank is not None else " (any accepted)")))

    skews = [b["ts"] - t for b, t in zip(batches, recv_times)
             if isinstance(b.get("ts"), (int, float))]
    if not skews:
        out.append(Check(worker, "clock", SKIP, "no batch timestamp"))
    else:
        worst = max(skews, key=abs)
        if abs(worst) > max_skew_s:
            out.append(Check(worker, "clock", FAIL,
                             f"the engine's event timestamps are {worst:+.1f} s from this "
                             f"host's clock",
                             "synchronise the clocks (NTP / chrony) of the engine and router "
                             "hosts: event ages and stale_after_s compare them"))
        else:
            out.append(Check(worker, "clock", OK, f"event ts within {abs(worst):.2f} s"))
    return out


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# -- the live checks ---------------------------------------------------------------------------

class _Events:
    """A SUB socket of the doctor's own on one worker's endpoint."""

    def __init__(self, ctx: Any, endpoint: str, bind: bool, topic: str) -> None:
        import zmq

        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def drain(self, until: float, stop: Any = None) -> List[Tuple[Optional[int], bytes, float]]:
        """``(seq or None, payload, arrival time)`` per message until ``until`` (monotonic),
        or earlier once ``stop(messages)`` is true."""
        import zmq

        got: List[Tuple[Optional[int], bytes, float]] = []
        while True:
            left = until - time.monotonic()
            if left <= 0 or (stop is not None and got and stop(got)):
                return got
            if self.sock.poll(int(min(left, 0.05) * 1000) + 1, zmq.POLLIN):
                frames = self.sock.recv_multipart()
                seq = (struct.unpack(">Q", frames[1])[0]
                       if len(frames) >= 3 and len(frames[1]) == 8 else None)
                got.append((seq, frames[-1], time.time()))

    def discard(self) -> int:
        """Drops the messages already queued (they predate the probe); returns how many."""
        import zmq

        n = 0
        while self.sock.poll(0, zmq.POLLIN):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(0)


def _replay_answers(ctx: Any, endpoint: str, timeout_s: float) -> Optional[str]:
    """None when the replay ROUTER answered, else why not."""
    import zmq

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart([b"", struct.pack(">Q", 0)])
        if not s.poll(int(timeout_s * 1000), zmq.POLLIN):
            return f"no answer within {timeout_s:g} s"
        frames = s.recv_multipart()
        if len(frames) < 3 or len(frames[-2]) != 8:
            return f"an answer that is not a replay reply ({len(frames)} frames)"
        return None
    finally:
        s.close(0)


def _probe_tokens(n_blocks: int, block_size: int) -> List[int]:
    """Fresh token ids (ids 1000-30000: inside every current vocabulary), so no engine has
    these blocks cached and a BlockStored follows; plus half a block that stays uncached."""
    rng = random.Random(time.time_ns())
    return [rng.randrange(1000, 30000) for _ in range(n_blocks * block_size + block_size // 2)]


def run(workers: Sequence[Any], *, block_size: int, topic: str = "", model: Optional[str] = None,
        tokenizer: Any = None, timeout_s: float = 3.0, settle_s: float = 0.3,
        max_skew_s: float = 2.0, probe_blocks: int = 4, http: Any = None) -> List[Check]:
    """Runs every check against live engines.

    Parameters
    ----------
    workers:
        `kvroute.Worker` objects (``RouterConfig.workers()``).
    block_size, topic:
        The router's block size and SUB topic.
    model:
        The served model name the probe and ``/tokenize`` requests carry (``None``: asked of
        ``GET /v1/models``).
    tokenizer:
        The router's `kvroute.prompt.PromptTokenizer`, or ``None`` (the
        tokenization check then warns: text and chat route without a prefix match).
    timeout_s:
        Seconds to wait for the probe's events (and for the replay answer), per worker.
    settle_s:
        Seconds between subscribing and probing (ZeroMQ drops what a PUB sends before the
        subscription reaches it).
    http:
        An ``httpx.Client`` (default: one of its own, 10 s timeout).

    Returns
    -------
    list of Check
        Per worker, in order: topology, reachable, events, block_size, stored_tokens,
        dp_rank, clock, replay, tokenization.
    """
    import httpx
    import zmq

    from kvroute import decode_batch

    own = http is None
    client = http if http is not None else httpx.Client(timeout=10.0)
    ctx = zmq.Context()
    out: List[Check] = []
    try:
        topo = {c.worker: c for c in check_topology(workers)}
        for w in workers:
            out.append(topo[w.name])
            out.extend(_run_worker(w, ctx, client, decode_batch, topo[w.name], block_size,
                                   topic, model, tokenizer, timeout_s, settle_s, max_skew_s,
                                   probe_blocks))
    finally:
        ctx.destroy(0)
        if own:
            client.close()
    return out


def _run_worker(w: Any, ctx: Any, client: Any, decode_batch: Any, topo: Check, block_size: int,
                topic: str, model: Optional[str], tokenizer: Any, timeout_s: float,
                settle_s: float, max_skew_s: float, probe_blocks: int) -> List[Check]:
    import httpx

    out: List[Check] = []
    name, url = w.name, w.url.rstrip("/")
    later = ("events", "block_size", "stored_tokens", "dp_rank", "clock", "replay",
             "tokenization")
    try:
        r = client.get(url + "/v1/models")
        served = [m.get("id") for m in (r.json().get("data") or [])] if r.status_code == 200 \
            else []
        if r.status_code != 200:
            raise httpx.HTTPError(f"GET /v1/models answered {r.status_code}")
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        out.append(Check(name, "reachable", FAIL, f"{url}: {type(e).__name__}: {e}",
                         "check the worker url (scheme, host, port) and that the engine is "
                         "running and listening on that address"))
        return out + [Check(name, c, SKIP, "the engine is unreachable") for c in later]
    if model is not None and served and model not in served:
        out.append(Check(name, "reachable", WARN, f"serves {served}, not {model!r}",
                         f"set serving.model (or --model) to one of {served}"))
    else:
        out.append(Check(name, "reachable", OK, f"serves {served}"))
    use_model = model if model is not None and (not served or model in served) else \
        (served[0] if served else model)

    probe = _probe_tokens(probe_blocks, block_size)
    events_check: Optional[Check] = None
    batches: List[Mapping[str, Any]] = []
    recv: List[float] = []
    sub: Optional[_Events] = None
    if not w.kv_endpoint:
        events_check = Check(name, "events", SKIP, "no kv_events endpoint configured")
    elif topo.status == FAIL and not w.bind and _is_wildcard(_host_of(w.kv_endpoint)):
        events_check = Check(name, "events", SKIP, "the endpoint is a wildcard (topology)")
    else:
        try:
            sub = _Events(ctx, w.kv_endpoint, w.bind, topic)
        except Exception as e:  # noqa: BLE001 - zmq.ZMQError and bad endpoints alike
            err = str(e)
            fix = ("the engine already binds this address (vLLM binds a wildcard endpoint): "
                   "set bind: false and give the engine's host" if w.bind and
                   "in use" in err.lower() else "check the kv_events endpoint's form "
                   "(tcp://host:port)")
            events_check = Check(name, "events", FAIL,
                                 f"cannot {'bind' if w.bind else 'connect to'} "
                                 f"{w.kv_endpoint}: {err}", fix)
    if sub is not None:
        try:
            time.sleep(settle_s)
            sub.discard()  # whatever was already queued is not the probe's
            t0 = time.monotonic()
            body: Dict[str, Any] = {"prompt": probe, "max_tokens": 1, "temperature": 0}
            if use_model is not None:
                body["model"] = use_model
            headers = {"X-data-parallel-rank": str(w.dp_rank)} if w.dp_rank is not None else {}
            try:
                pr = client.post(url + "/v1/completions", json=body, headers=headers)
                probe_err = None if pr.status_code == 200 else \
                    f"the probe request answered {pr.status_code}: {pr.text[:200]}"
            except httpx.HTTPError as e:
                probe_err = f"the probe request failed: {type(e).__name__}: {e}"
            want = len(probe) // block_size

            def enough(msgs: List[Tuple[Optional[int], bytes, float]]) -> bool:
                n = 0
                for _, payload, _t in msgs:
                    b, _ = decode_batch(payload)
                    for ev in (b or {}).get("events", ()):
                        if ev.get("type") == "BlockStored":
                            n += len(ev.get("block_hashes") or ())
                return n >= want

            msgs = sub.drain(time.monotonic() + timeout_s, enough)
            elapsed = time.monotonic() - t0
            for _seq, payload, t in msgs:
                b, _ = decode_batch(payload)
                if b is not None:
                    batches.append(b)
                    recv.append(t)
            seqs = [s for s, _, _ in msgs if s is not None]
            if probe_err is not None and not msgs:
                events_check = Check(name, "events", FAIL, probe_err,
                                     "the engine refused a completions request with token-id "
                                     "prompt; check the model name and max_model_len")
            elif not msgs:
                events_check = Check(
                    name, "events", FAIL,
                    f"no event batch arrived on {w.kv_endpoint} within {elapsed:.1f} s of a "
                    "probe request",
                    "start the engine with --kv-events-config '{\"enable_kv_cache_events\":"
                    "true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:<port>\"}'; check the "
                    "port and topic" + (" and that the engine connects to this bound address"
                                        if w.bind else
                                        "; if the engine's endpoint is not a wildcard "
                                        "(tcp://*:N) vLLM connects to it: then set bind: true "
                                        "on this worker, with that address"))
            else:
                adv = (f", sequence {seqs[0]} -> {seqs[-1]}" if seqs else
                       " (no sequence numbers: gaps cannot be detected)")
                events_check = Check(name, "events", OK if seqs else WARN,
                                     f"{len(msgs)} batches after the probe{adv}",
                                     None if seqs else "publish with vLLM's 3-frame "
                                     "[topic, seq, payload] messages")
        finally:
            sub.close()
    assert events_check is not None
    out.append(events_check)
    if events_check.status in (OK, WARN):
        out.extend(check_stored(name, probe, batches, block_size=block_size,
                                dp_rank=w.dp_rank, recv_times=recv, max_skew_s=max_skew_s))
    else:
        out.extend(Check(name, c, SKIP, "no events to check")
                   for c in ("block_size", "stored_tokens", "dp_rank", "clock"))

    if not w.replay_endpoint:
        out.append(Check(name, "replay", SKIP, "no replay endpoint configured (a sequence "
                         "gap drops the worker's state)"))
    else:
        why: Optional[str]
        try:
            why = _replay_answers(ctx, w.replay_endpoint, min(timeout_s, 2.0))
        except Exception as e:  # noqa: BLE001
            why = f"{type(e).__name__}: {e}"
        out.append(Check(name, "replay", OK, f"{w.replay_endpoint} answers") if why is None
                   else Check(name, "replay", FAIL, f"{w.replay_endpoint}: {why}",
                              "give the engine's --kv-events-config replay_endpoint with its "
                              "host (e.g. tcp://engine-host:5558), or remove replay:"))
    out.append(_check_tokenization(name, url, client, tokenizer, use_model))
    return out


def _check_tokenization(name: str, url: str, client: Any, tokenizer: Any,
                        model: Optional[str]) -> Check:
    import httpx

    if tokenizer is None:
        return Check(name, "tokenization", WARN, "the router has no tokenizer: text and chat "
                     "prompts route without a prefix match",
                     "give kvroute the engine's tokenizer directory (serving.tokenizer, "
                     "--tokenizer or model_path)")
    bad: List[str] = []
    for path, body in (("/v1/completions", {"prompt": SAMPLE_PROMPT}),
                       ("/v1/chat/completions", {"messages": SAMPLE_CHAT})):
        req = dict(body)
        if model is not None:
            req["model"] = model
        try:
            r = client.post(url + "/tokenize", json=req)
        except httpx.HTTPError as e:
            return Check(name, "tokenization", SKIP, f"POST /tokenize failed: {e}")
        if r.status_code == 404:
            return Check(name, "tokenization", SKIP, "the engine has no POST /tokenize")
        if r.status_code != 200:
            return Check(name, "tokenization", SKIP,
                         f"POST /tokenize answered {r.status_code}: {r.text[:200]}")
        engine = [int(t) for t in (r.json().get("tokens") or [])]
        ours = [int(t) for t in tokenizer.encode_request(path, body)]
        if ours != engine:
            i = _first_diff(ours, engine)
            kind = "chat template" if path.endswith("chat/completions") else "tokenizer"
            bad.append(f"{kind}: router {len(ours)} tokens, engine {len(engine)}, first "
                       f"difference at {i} (router {ours[i:i + 3]}, engine {engine[i:i + 3]})")
    if bad:
        return Check(name, "tokenization", FAIL, "; ".join(bad),
                     "give kvroute the engine's own tokenizer.json and tokenizer_config.json "
                     "(with the chat template the engine uses: its --chat-template, if any) "
                     "through serving.tokenizer or --tokenizer")
    return Check(name, "tokenization", OK, "a completions prompt and a chat tokenize alike")


# -- output ----------------------------------------------------------------------------------

def format_report(checks: Sequence[Check]) -> str:
    """One line per check, grouped by worker, a ``fix:`` line under each failure or warning,
    and a summary line."""
    lines: List[str] = []
    last = None
    for c in checks:
        if c.worker != last:
            lines.append(f"{c.worker}")
            last = c.worker
        lines.append(f"  {c.status.upper():4}  {c.name:13} {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f"        fix: {c.fix}")
    n = {s: sum(1 for c in checks if c.status == s) for s in (OK, WARN, FAIL, SKIP)}
    lines.append(f"{n[FAIL]} failed, {n[WARN]} warnings, {n[OK]} ok, {n[SKIP]} skipped")
    return "\n".join(lines)


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0."""
    return 1 if any(c.status == FAIL for c in checks) else 0
