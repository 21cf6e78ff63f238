"""`kvroute replay` on bad input: one line on stderr, exit code 2, no traceback, and nothing
replayed (every argument is checked before any policy runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from _util import require

from kvroute import cli


def _mooncake_line(ts_ms: float = 0.0) -> str:
    return json.dumps({"timestamp": ts_ms, "input_length": 600, "output_length": 4,
                       "hash_ids": [1, 2]})


@pytest.fixture
def good_trace(tmp_path):
    p = tmp_path / "good.jsonl"
    p.write_text("\n".join(_mooncake_line(100.0 * i) for i in range(3)) + "\n")
    return p


@pytest.fixture
def no_replay(monkeypatch):
    """Fails the test if a policy starts replaying."""
    import kvroute.replay.runner as runner

    def boom(*a, **k):
        raise AssertionError("a policy ran although the arguments are bad")

    monkeypatch.setattr(runner, "replay", boom)
    monkeypatch.setattr(runner, "run_policy", boom)


def _bad(capsys, argv, *expect):
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--no-progress", *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for e in expect:
        assert e in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv,expect", [
    (["--workers", "0"], ["--workers", ">= 1"]),
    (["--workers", "-3"], ["--workers"]),
    (["--workers", "abc"], ["--workers", "abc"]),
    (["--speed", "-1"], ["--speed"]),
    (["--speed", "0"], ["--speed"]),
    (["--speed", "nan"], ["--speed"]),
    (["--speed", "inf"], ["--speed"]),
    (["--cache-weight", "2"], ["--cache-weight", "[0, 1]"]),
    (["--cache-weight", "-0.1"], ["--cache-weight"]),
    (["--block-size", "0"], ["--block-size"]),
    (["--kv-capacity-blocks", "0"], ["--kv-capacity-blocks"]),
    (["--jobs", "0"], ["--jobs", ">= 1"]),
    (["--policies", ""], ["--policies", "empty"]),
    (["--policies", " , "], ["--policies"]),
    (["--policies", "kv_aware,"], ["--policies", "empty name"]),
    (["--policies", "kv_aware,kv_awre"], ["kv_awre", "kv_aware"]),
    (["--limit", "0"], ["--limit", ">= 1"]),
    (["--limit", "-5"], ["--limit"]),
    (["--event-delay-ms", "-1"], ["--event-delay-ms"]),
    (["--speculative-ttl-s", "-1"], ["--speculative-ttl-s"]),
    (["--pd", "4"], ["--pd"]),
    (["--pd", "0:4"], ["--pd"]),
    (["--pd", "2:2", "--decode-policy", "nope"], ["nope"]),
    (["--era", "bogus"], ["--era"]),
])
def test_bad_arguments_fail_cleanly_before_any_policy_runs(capsys, no_replay, good_trace, argv,
                                                           expect):
    _bad(capsys, ["--trace", str(good_trace), *argv], *expect)


def test_unknown_flag_is_argparse_usage_error(capsys, no_replay, good_trace):
    """Unknown flags are the top-level parser's: its usage line, then one error line."""
    with pytest.raises(SystemExit) as ei:
        cli.main(["replay", "--trace", str(good_trace), "--no-such-flag"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--no-such-flag" in err


def test_missing_trace_file(capsys, no_replay, tmp_path):
    _bad(capsys, ["--trace", str(tmp_path / "absent.jsonl")], "absent.jsonl")


def test_malformed_line_names_the_line(capsys, no_replay, tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(_mooncake_line() + "\n" + "{not json\n" + _mooncake_line(5.0) + "\n")
    _bad(capsys, ["--trace", str(p)], "bad.jsonl:2")


@pytest.mark.parametrize("line", [
    {"timestamp": 0, "input_length": 600, "output_length": 4},                  # no hash_ids
    {"timestamp": 0, "input_length": 6000, "output_length": 4, "hash_ids": [1]},  # too long
    {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": "ab"},
    {"timestamp": 0, "input_length": 600, "output_length": -1, "hash_ids": [1, 2]},
    [1, 2, 3],
])
def test_invalid_mooncake_fields_name_the_line(capsys, no_replay, tmp_path, line):
    p = tmp_path / "bad.jsonl"
    p.write_text(_mooncake_line() + "\n" + json.dumps(line) + "\n")
    _bad(capsys, ["--trace", str(p)], "bad.jsonl:2")


def test_empty_trace(capsys, no_replay, tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    _bad(capsys, ["--trace", str(p)], "no requests")


def test_directory_as_trace(capsys, no_replay, tmp_path):
    _bad(capsys, ["--trace", str(tmp_path)], str(tmp_path))


def test_subprocess_exit_code_and_single_line(good_trace):
    """The installed entry point's path: a real interpreter, stderr and exit status."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from kvroute.cli import main; sys.exit(main())",
         "replay", "--trace", str(good_trace), "--policies", "kv_aware,kv_awre",
         "--no-progress"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "kv_awre" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing ran, nothing printed


def test_limit_replays_that_many(tmp_path, good_trace, capsys):
    out = tmp_path / "out"
    assert cli.main(["replay", "--trace", str(good_trace), "--limit", "2", "--workers", "2",
                     "--policies", "round_robin", "--no-progress", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["requests"] == 2
    assert [r["requests"] for r in res["results"]] == [2]


def test_openai_log_replays_from_the_command_line(tmp_path, qwen3, capsys):
    require("jinja2")
    system = {"role": "system", "content": "You answer in one sentence. " * 20}
    rows = []
    for c in range(3):
        msgs = [system, {"role": "user", "content": f"Question {c}: what is {c} squared?"}]
        rows.append({"timestamp": 10.0 + c, "session_id": f"c{c}",
                     "body": {"model": "m", "messages": msgs, "max_tokens": 8}})
        msgs = msgs + [{"role": "assistant", "content": f"{c * c}."},
                       {"role": "user", "content": "And cubed?"}]
        rows.append({"timestamp": 14.0 + c, "session_id": f"c{c}",
                     "body": {"model": "m", "messages": msgs, "max_tokens": 8}})
    p = tmp_path / "log.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert cli.main(["replay", "--trace", str(p), "--tokenizer", str(qwen3), "--workers", "2",
                     "--policies", "kv_aware", "--no-progress", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["results"][0]["requests"] == 6
    assert res["results"][0]["hit_rate"] > 0  # the second turns reuse the first turns' blocks


def test_format_flag_needs_a_file(capsys, no_replay):
    _bad(capsys, ["--trace", "synthetic", "--format", "tokens"], "--format")


def test_forced_format_mismatch_names_the_line(capsys, no_replay, good_trace):
    _bad(capsys, ["--trace", str(good_trace), "--format", "tokens"], "good.jsonl:1")


def test_results_json_is_byte_identical_across_runs(tmp_path, capsys):
    """Simulated results depend only on the arguments and seed (not on the policies running
    one after the other or in parallel processes); wall-clock timings go to timings.json."""
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        assert cli.main(["replay", "--trace", "synthetic", "--limit", "120", "--workers", "2",
                         "--kv-capacity-blocks", "300", "--policies",
                         "kv_aware,round_robin,cache_aware", "--seed", "7", "--no-progress",
                         "--jobs", str(1 + 2 * i), "--out", str(out)]) == 0
        outs.append(out)
    a, b = ((o / "results.json").read_bytes() for o in outs)
    assert a == b
    assert (outs[0] / "results.csv").read_bytes() == (outs[1] / "results.csv").read_bytes()
    res = json.loads(a)
    assert "wall_s" not in res["meta"]
    assert all("wall_s" not in r and "route_us_p50" not in r for r in res["results"])
    t = json.loads((outs[0] / "timings.json").read_text())
    assert t["wall_s"] > 0
    assert [r["policy"] for r in t["results"]] == ["kv_aware", "round_robin", "cache_aware"]
    assert all(r["wall_s"] > 0 and r["route_us_p99"] >= r["route_us_p50"] > 0
               for r in t["results"])
    assert (outs[0] / "results.png").stat().st_size > 0
    bound = res["meta"]["capacity_bound"]
    assert 0 < bound < res["meta"]["infinite_cache_bound"]  # the capacity binds here
    for r in res["results"]:
        assert r["hit_rate"] <= bound + 1e-12  # no routing beats the pooled optimum
        assert r["share_of_capacity_bound"] == pytest.approx(r["hit_rate"] / bound)
    assert "of cap bound" in capsys.readouterr().out


def test_openai_log_without_a_tokenizer(capsys, no_replay, tmp_path, monkeypatch):
    monkeypatch.delenv("KVROUTE_SHARED_DATA", raising=False)
    p = tmp_path / "log.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "body": {"prompt": "hi"}}) + "\n")
    _bad(capsys, ["--trace", str(p)], "--tokenizer")
    _bad(capsys, ["--trace", str(p), "--tokenizer", str(tmp_path)], "tokenizer.json")


@pytest.mark.parametrize("argv,expect", [
    (["--bogus"], "unknown option '--bogus'"),
    ([], "required: cmd"),
    (["nope"], "invalid choice"),
    (["serve", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--workers", "x"], "kvroute demo: error"),
])
def test_top_level_usage_errors_are_one_line(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err and "Traceback" not in err


@pytest.mark.slow  # two engine processes: 10-13 s here
def test_engines_replays_against_live_engines(tmp_path, capsys, shared_data):
    """--engines: two stand-in engines (real HTTP, real KV events); the hit rate is what the
    engines report as cached_tokens, beside the router's prediction."""
    from kvroute.sim.server import EngineServerProcess

    tok = shared_data / "tokenizers" / "qwen3"
    with EngineServerProcess(tokenizer_dir=tok, token_delay_s=0.001) as a, \
            EngineServerProcess(tokenizer_dir=tok, token_delay_s=0.001) as b:
        spec = f"{a.url}@{a.kv_endpoint},{b.url}@{b.kv_endpoint}"
        assert cli.main(["replay", "--trace", "mt_bench", "--data-dir", str(shared_data),
                         "--limit", "40", "--speed", "20", "--policies", "kv_aware",
                         "--engines", spec, "--no-progress", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    row = res["results"][0]
    assert res["meta"]["engines"] == [a.url, b.url] and row["requests"] == 40
    assert 0 < row["hit_rate"] <= 1 and 0 < row["predicted_hit_rate"] <= 1
    assert "live: 2 engines" in capsys.readouterr().out


def test_engines_spec_errors_are_one_line(capsys):
    for argv, expect in ((["--engines", "http://a:1"], "URL@KV_ENDPOINT"),
                         (["--engines", "http://a:1@tcp://a:2", "--pd", "1:1"], "--pd")):
        with pytest.raises(SystemExit) as e:
            cli.main(["replay", "--trace", "synthetic", *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expect in err


def test_live_request_is_sent_again_when_a_kept_alive_connection_was_closed():
    """A server that closes a connection without answering (as an engine closes an idle
    keep-alive connection while it is being reused): the request goes out once more on a fresh
    connection; a second failure is raised."""
    import asyncio

    import httpx

    from kvroute.replay.live import _stream

    async def main(fail_first: int) -> tuple:
        conns = []

        async def handle(reader, writer):
            conns.append(1)
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n")
                         if ln.lower().startswith(b"content-length")))
            await reader.readexactly(n)
            if len(conns) <= fail_first:
                writer.close()  # no response byte
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient() as client:
                async with _stream(client, f"http://127.0.0.1:{port}/v1/completions",
                                   {"prompt": [1]}) as resp:
                    return resp.status_code, await resp.aread(), len(conns)
        finally:
            server.close()

    assert asyncio.run(main(fail_first=1)) == (200, b"ok", 2)
    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(main(fail_first=2))


def test_adaptive_replay_reports_where_the_tuner_ended(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["replay", "--trace", "synthetic", "--limit", "250", "--workers", "2",
                     "--kv-capacity-blocks", "300", "--policies", "kv_aware",
                     "--adaptive-cache-weight", "--cache-weight", "0.7",
                     "--speculative-ttl-s", "2", "--no-progress", "--out", str(out)]) == 0
    (r,) = json.loads((out / "results.json").read_text())["results"]
    assert r["policy"] == "kv_aware adaptive"
    assert 0.4 <= r["final_cache_weight"] <= 0.85  # the default bounds
    assert 0.5 <= r["final_speculative_ttl_s"] <= 8.0  # a quarter to four times the TTL
