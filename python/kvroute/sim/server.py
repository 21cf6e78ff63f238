"""Engine stand-in: a real HTTP server speaking vLLM's OpenAI-compatible API that publishes
real vLLM-format KV events over ZeroMQ for the prompts it serves.

It is a **stand-in** for ``vllm serve`` (vLLM needs a GPU; this machine has none). What is
real: the HTTP API shapes (``vllm/entrypoints/openai/``: completions, chat completions with
SSE streaming, ``usage.prompt_tokens_details.cached_tokens``, OpenAI error JSON), the Qwen3
tokenizer and chat template (tokenized as vLLM does), the prefix cache
(`kvroute.sim.block_pool.BlockPool`: full prompt blocks, LRU eviction, blocks of running
requests pinned), the KV events (`kvroute.sim.publisher.EventPublisher`: vLLM wire, map era,
3 frames with sequence numbers, replay ROUTER), the ``/metrics`` names and the ORCA load
header. What is not: the model. Output tokens are deterministic words drawn from a hash of
the prompt, one every ``token_delay_s`` seconds, always ``max_tokens`` of them
(``finish_reason`` "length").

Three layers, each usable alone (all importable from here):

* `StandinEngine` (`kvroute.sim.standin_engine`): the engine logic without HTTP (tokenize,
  prefill, generate, stats); reusable inside a Ray Serve replica. vLLM's request
  preprocessing it reproduces is in `kvroute.sim.vllm_protocol`.
* `create_app` (`kvroute.sim.standin_app`): a FastAPI app over one engine.
* `EngineServerProcess` (this module): runs ``python -m kvroute.sim.server ...`` as a
  subprocess (real sockets, killable with SIGKILL like a crashed engine).

Thread-safety: `StandinEngine` methods may be called from any thread; one lock guards the
block pool, the counters and the publisher. `StandinEngine.generate` must be iterated on an
asyncio event loop (any loop; admission waiters are woken with ``call_soon_threadsafe``).

Run ``python -m kvroute.sim.server --help`` for the CLI.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Union

from kvroute.sim.standin_app import create_app
from kvroute.sim.standin_engine import (
    DEFAULT_MODEL,
    Generation,
    StandinEngine,
    default_tokenizer_dir,
)
from kvroute.sim.vllm_protocol import (
    ORCA_REQUEST_HEADER,
    ORCA_RESPONSE_HEADER,
    orca_header,
    vllm_chat_messages,
    vllm_tool_dicts,
)

__all__ = [
    "DEFAULT_MODEL",
    "ORCA_REQUEST_HEADER",
    "ORCA_RESPONSE_HEADER",
    "EngineServerProcess",
    "Generation",
    "StandinEngine",
    "create_app",
    "default_tokenizer_dir",
    "main",
    "orca_header",
    "vllm_chat_messages",
    "vllm_tool_dicts",
]


# ------------------------------------------------------------------------------------------
# Subprocess wrapper and CLI
# ------------------------------------------------------------------------------------------

def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineServerProcess:
    """``python -m kvroute.sim.server`` as a subprocess: a stand-in engine with its own
    HTTP port, KV-event PUB port and (optionally) replay port on ``host``.

    Parameters
    ----------
    port, kv_port, replay_port:
        TCP ports; ``None`` picks free ones (asked of the OS when the object is made; if one
        was taken meanwhile, `start` retries with new ones).
    replay:
        Serve a replay ROUTER (``replay_endpoint``) or not (``None``).
    model, tokenizer_dir, block_size, capacity_blocks, token_delay_s, max_num_seqs, seed:
        As `StandinEngine`.
    host:
        Address every socket binds (default loopback).

    Attributes
    ----------
    url: str
        ``"http://HOST:PORT"``.
    kv_endpoint: str
        ``"tcp://HOST:KV_PORT"``.
    replay_endpoint: Optional[str]
        ``"tcp://HOST:REPLAY_PORT"`` or ``None``.
    proc: Optional[subprocess.Popen]
    log_path: str
        The subprocess's stdout + stderr.
    """

    def __init__(self, *, port: Optional[int] = None, kv_port: Optional[int] = None,
                 replay_port: Optional[int] = None, replay: bool = True,
                 model: str = DEFAULT_MODEL,
                 tokenizer_dir: Optional[Union[str, os.PathLike]] = None,
                 block_size: int = 16, capacity_blocks: int = 4096, token_delay_s: float = 0.0,
                 host: str = "127.0.0.1", max_num_seqs: int = 256, seed: int = 0) -> None:
        self.host = host
        self.replay = replay
        self._auto_ports = port is None or kv_port is None or (replay and replay_port is None)
        self._fixed = (port, kv_port, replay_port)
        self.model = model
        tdir = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
        self.tokenizer_dir = str(tdir.resolve())
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.token_delay_s = token_delay_s
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.proc: Optional[subprocess.Popen] = None
        fd, self.log_path = tempfile.mkstemp(prefix="kvroute-standin-", suffix=".log")
        os.close(fd)
        self._pick_ports()

    def _pick_ports(self) -> None:
        port, kv_port, replay_port = self._fixed
        self.port = port if port is not None else _free_port(self.host)
        self.kv_port = kv_port if kv_port is not None else _free_port(self.host)
        self.replay_port = (replay_port if replay_port is not None else _free_port(self.host)) \
            if self.replay else None
        self.url = f"http://{self.host}:{self.port}"
        self.kv_endpoint = f"tcp://{self.host}:{self.kv_port}"
        self.replay_endpoint = (f"tcp://{self.host}:{self.replay_port}" if self.replay
                                else None)

    def command(self) -> List[str]:
        """The subprocess's argv."""
        return [sys.executable, "-m", "kvroute.sim.server", "--host", self.host,
                "--port", str(self.port), "--kv-endpoint", self.kv_endpoint,
                "--replay-endpoint", self.replay_endpoint or "none", "--model", self.model,
                "--tokenizer-dir", self.tokenizer_dir, "--block-size", str(self.block_size),
                "--capacity-blocks", str(self.capacity_blocks),
                "--token-delay-ms", repr(self.token_delay_s * 1000.0),
                "--max-num-seqs", str(self.max_num_seqs), "--seed", str(self.seed)]

    def start(self, timeout: float = 30) -> "EngineServerProcess":
        """Starts the subprocess and waits until ``GET /health`` answers 200 and
        ``GET /standin/stats`` reports this engine's ``kv_endpoint``.

        The second check tells a port clash apart: with ports picked automatically, another
        stand-in may have taken the same HTTP port meanwhile, and its ``/health`` would answer
        for ours. Such a clash (an answer from another engine, or "address already in use"
        in the log) is retried with new ports, at most 3 times in all.

        Raises
        ------
        RuntimeError
            Already started, the process exited (its log is in the message), or another
            engine answers on the port and the ports were given.
        TimeoutError
            No healthy answer within ``timeout`` seconds (the process is killed).
        """
        import httpx

        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self!r} is already running")
        attempts = 3 if self._auto_ports else 1
        for attempt in range(attempts):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.command(), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            end = time.monotonic() + timeout
            clash: Optional[str] = None
            with httpx.Client(timeout=2.0) as client:
                while True:
                    code = self.proc.poll()
                    if code is not None:
                        break
                    try:
                        if client.get(f"{self.url}/health").status_code == 200:
                            theirs = client.get(f"{self.url}/standin/stats").json().get(
                                "kv_endpoint")
                            if theirs == self.kv_endpoint:
                                return self
                            clash = theirs  # another engine answers on our HTTP port
                            break
                    except (httpx.HTTPError, ValueError, AttributeError):
                        pass  # not up yet, or not (yet) a stand-in's answer
                    if time.monotonic() > end:
                        self.kill()
                        raise TimeoutError(f"stand-in engine at {self.url} not healthy after "
                                           f"{timeout} s; log:\n{self._log_tail()}")
                    time.sleep(0.05)
            if clash is not None:
                self.kill()
                if attempt + 1 >= attempts:
                    raise RuntimeError(f"another engine (kv_endpoint {clash!r}) answers on "
                                       f"{self.url}; log:\n{self._log_tail()}")
                self._pick_ports()
                continue
            log_text = self._log_tail()
            in_use = "address already in use" in log_text.lower() or "EADDRINUSE" in log_text
            if not (in_use and attempt + 1 < attempts):
                raise RuntimeError(f"stand-in engine exited with {code} before it was healthy; "
                                   f"log:\n{log_text}")
            self._pick_ports()
        raise AssertionError("unreachable")

    def _log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crashed engine: no shutdown, the kernel closes its sockets. Waits
        for the process to be reaped. No-op if not running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM (uvicorn's graceful shutdown, then the engine's sockets are closed) and
        wait; SIGKILL after ``timeout`` seconds. No-op if not running."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def worker(self) -> Any:
        """``kvroute.Worker(url, kv_endpoint=..., replay_endpoint=...)`` for this engine."""
        from kvroute import Worker

        return Worker(self.url, kv_endpoint=self.kv_endpoint,
                      replay_endpoint=self.replay_endpoint)

    def __enter__(self) -> "EngineServerProcess":
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __repr__(self) -> str:
        return (f"EngineServerProcess(url={self.url!r}, kv_endpoint={self.kv_endpoint!r}, "
                f"replay_endpoint={self.replay_endpoint!r}, running={self.running})")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI: serve one stand-in engine with uvicorn until SIGINT / SIGTERM."""
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m kvroute.sim.server",
        description="vLLM engine stand-in: OpenAI-compatible HTTP API + real KV events over "
                    "ZeroMQ (no model; deterministic output).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-endpoint", default="tcp://127.0.0.1:*",
                   help="KV-event PUB bind address (vLLM kv-events-config endpoint)")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:*",
                   help="replay ROUTER bind address, or 'none'")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument("--tokenizer-dir", default=None,
                   help="tokenizer.json + tokenizer_config.json (default "
                        "$KVROUTE_SHARED_DATA/tokenizers/qwen3)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-blocks", type=int, default=4096)
    p.add_argument("--token-delay-ms", type=float, default=0.0,
                   help="milliseconds between output tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topic", default="", help="KV-event topic frame (vLLM default '')")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    replay = None if a.replay_endpoint.lower() in ("", "none") else a.replay_endpoint
    engine = StandinEngine(model=a.model, tokenizer_dir=a.tokenizer_dir,
                           block_size=a.block_size, capacity_blocks=a.capacity_blocks,
                           kv_endpoint=a.kv_endpoint, replay_endpoint=replay, seed=a.seed,
                           token_delay_s=a.token_delay_ms / 1000.0, max_num_seqs=a.max_num_seqs,
                           topic=a.topic)
    print(json.dumps({"url": f"http://{a.host}:{a.port}", "kv_endpoint": engine.kv_endpoint,
                      "replay_endpoint": engine.replay_endpoint, "model": a.model}), flush=True)
    try:
        uvicorn.run(create_app(engine), host=a.host, port=a.port, log_level=a.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
