"""The manylinux wheel, installed where nothing else of kvroute is: `scripts/build_wheel.sh`
builds and repairs it (or $KVROUTE_WHEEL names one already built), a fresh virtual environment
installs it from that file alone (numpy, msgspec and pyzmq come from pip's usual index or its
cache), the dynamic loader resolves the installed extension to the wheel's own kvroute.libs/ and
the allowed system libraries only, and the smoke path runs there: real engine captures published
over a real ZeroMQ socket, ingested by `Router`, matched by `select_worker`.

Run as a script (``python tests/test_wheel.py KVEVENTS_DIR``) it is that smoke path alone: the
test runs it with the virtual environment's interpreter, and it needs only kvroute's base
dependencies plus pyzmq for the publishers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# glibc and the GCC runtime: what manylinux lets a wheel take from the system (libresolv is
# glibc's too; the grafted MIT Kerberos libraries need it).
ALLOWED_SYSTEM = ("libc.so", "libm.so", "libstdc++.so", "libgcc_s.so", "libpthread.so",
                  "librt.so", "libdl.so", "libresolv.so", "ld-linux", "linux-vdso.so")

SGLANG_CAPTURE = "sglang_qwen2.5-0.5b_blockstored_map.payload.msgpack"
VLLM_CAPTURE = "vllm_qwen3-0.6b_blockstored_arraylike.payload.msgpack"


# -- the smoke path (runs inside the wheel's virtual environment) ----------------------------
def smoke(kvevents: Path) -> dict:
    """Publishes two real captures (MANIFEST.json gives their ZeroMQ frames) from PUB sockets
    bound on port 0 to a `Router` subscribed to two workers, and returns what it saw.

    - SGLang's capture (2 blocks of 64 tokens, no parent, topic + payload frames) goes to
      worker ``http://w1``; ``select_worker`` on its tokens should pick w1 with every token
      matched.
    - vLLM's capture (1 block of 16 tokens whose parent this router never saw; topic, 8-byte
      sequence 5, payload) goes to a second router (block_size 16): ingested as one event.
    """
    import msgspec
    import zmq

    import kvroute

    manifest = json.loads((kvevents / "MANIFEST.json").read_text())
    out: dict = {"kvroute": kvroute.__file__, "core": kvroute._core.__file__}
    ctx = zmq.Context()
    try:
        sg = (kvevents / SGLANG_CAPTURE).read_bytes()
        sg_event = kvroute.decode_batch(sg)[0]["events"][0]
        sg_topic = manifest[SGLANG_CAPTURE]["zmq_frames"]["topic"].encode()
        decision, stats = _publish_and_select(
            kvroute, ctx, msgspec, sg_event["block_size"], [sg_topic, sg], sg_topic,
            sg_event["token_ids"])
        out["sglang"] = {"worker": decision.worker, "matched_tokens": decision.matched_tokens,
                         "prompt_tokens": len(sg_event["token_ids"]),
                         "blocks": len(sg_event["block_hashes"]),
                         "blocks_stored": stats["blocks_stored"]}

        vl = (kvevents / VLLM_CAPTURE).read_bytes()
        vl_event = kvroute.decode_batch(vl)[0]["events"][0]
        frames = manifest[VLLM_CAPTURE]["zmq_frames"]
        vl_topic = frames["topic"].encode()
        _, stats = _publish_and_select(
            kvroute, ctx, msgspec, vl_event["block_size"],
            [vl_topic, bytes.fromhex(frames["seq_hex"]), vl], vl_topic, None)
        out["vllm"] = {"events": stats["events"], "last_seq": stats["last_seq"]}
    finally:
        ctx.term()
    return out


def _publish_and_select(kvroute, ctx, msgspec, block_size, frames, topic, tokens):
    """Two workers on PUB sockets; ``frames`` published by w1 once both have joined; returns
    (select_worker(tokens) or None, w1's stats once its event is counted)."""
    import zmq

    pubs = []
    router = None
    try:
        for _ in range(2):
            s = ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.bind("tcp://127.0.0.1:0")
            pubs.append(s)
        eps = [s.getsockopt(zmq.LAST_ENDPOINT).decode() for s in pubs]
        router = kvroute.Router([kvroute.Worker(f"http://w{i}", ep) for i, ep in enumerate(eps)],
                                block_size=block_size, speculative_ttl_s=0)

        def stats(i: int) -> dict:
            return router.stats()["workers"][f"http://w{i}"]

        # Slow joiner: an empty unsequenced batch from each until the router has seen one.
        empty = msgspec.msgpack.encode([time.time(), [], 0])
        end = time.monotonic() + 10
        while not all(stats(i)["batches"] for i in range(2)):
            assert time.monotonic() < end, f"subscribers never joined: {router.stats()}"
            for s in pubs:
                s.send_multipart([topic, empty])
            time.sleep(0.02)
        pubs[1].send_multipart(frames)
        end = time.monotonic() + 10
        while stats(1)["events"] < 1:
            assert time.monotonic() < end, f"capture never ingested: {router.stats()}"
            time.sleep(0.01)
        decision = router.select_worker(tokens) if tokens is not None else None
        return decision, stats(1)
    finally:
        if router is not None:
            router.close()
        for s in pubs:
            s.close(0)


if __name__ == "__main__":
    print(json.dumps(smoke(Path(sys.argv[1]))))
    sys.exit(0)


# -- the test ---------------------------------------------------------------------------------
import pytest  # noqa: E402  (the script above runs without pytest)
from _util import require_executable, require_file  # noqa: E402


def _build_wheel(out: Path) -> Path:
    """$KVROUTE_WHEEL if set, else scripts/build_wheel.sh into ``out``."""
    if os.environ.get("KVROUTE_WHEEL"):
        return Path(os.environ["KVROUTE_WHEEL"])
    for tool in ("cmake", "g++"):
        require_executable(tool)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 and re.search(
            r"Could NOT find|No matching distribution", proc.stderr):
        pytest.skip(f"cannot build the wheel here:\n{proc.stderr[-2000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("kvroute-*manylinux*.whl")
    return wheel


def _ldd(path: Path) -> dict:
    """soname -> resolved path (or "not found") as the dynamic loader sees ``path``."""
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, check=True).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+)(?: => (\S+(?: \S+)?))?", line)
        if m:
            libs[m.group(1)] = (m.group(2) or m.group(1)).split(" (")[0]
    return libs


@pytest.mark.slow
def test_wheel_installs_alone_resolves_only_its_own_libraries_and_routes(tmp_path, shared_data):
    kvevents = shared_data / "kvevents"
    require_file(kvevents / "MANIFEST.json", "the engine captures")
    require_executable("ldd")
    t0 = time.monotonic()
    wheel = _build_wheel(tmp_path / "wheelhouse")
    assert re.search(r"-manylinux_\d+_\d+_\w+\.whl$", wheel.name), wheel.name
    t_build = time.monotonic() - t0

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # kvroute from the wheel file only; its base dependencies and pyzmq from the usual index.
    subprocess.run(pip + ["--no-index", "--no-deps", str(wheel)], check=True)
    proc = subprocess.run(pip + [str(wheel), "pyzmq"], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot install numpy/msgspec/pyzmq into the venv:\n{proc.stderr[-1500:]}")
    t_venv = time.monotonic() - t0 - t_build

    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()
    (core,) = Path(site, "kvroute").glob("_core*.so")
    libs = _ldd(core)
    assert "not found" not in libs.values(), libs
    own = Path(site, "kvroute.libs").resolve()
    outside = {name: where for name, where in libs.items()
               if not Path(name).name.startswith(ALLOWED_SYSTEM)
               and not Path(where).resolve().is_relative_to(own)}
    assert outside == {}, f"{core.name} resolves libraries outside the wheel: {libs}"
    assert any(n.startswith("libzmq") for n in libs), libs  # the grafted copy, resolved above
    assert not any(n.startswith("libxxhash") for n in libs), libs  # compiled in

    # The smoke path, from the venv, away from the source tree (no kvroute on sys.path but the
    # installed one).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    proc = subprocess.run([str(py), str(Path(__file__).resolve()), str(kvevents)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert Path(seen["core"]).resolve() == core.resolve()
    sg = seen["sglang"]
    assert sg["worker"] == "http://w1"
    assert sg["matched_tokens"] == sg["prompt_tokens"] > 0
    assert sg["blocks_stored"] == sg["blocks"] > 0
    manifest = json.loads((kvevents / "MANIFEST.json").read_text())
    seq = manifest[VLLM_CAPTURE]["zmq_frames"]["seq_hex"]
    assert seen["vllm"] == {"events": 1, "last_seq": int(seq, 16)}
    print(f"wheel {wheel.name} {wheel.stat().st_size} bytes; build {t_build:.0f} s, "
          f"venv {t_venv:.0f} s, total {time.monotonic() - t0:.0f} s")
