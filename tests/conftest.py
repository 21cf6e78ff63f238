"""Shared fixtures: where the real data lives (and the Qwen3 tokenizer and MT-Bench questions
in it), a Hypothesis profile. Plain helpers the tests import are in _util.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _util, _publisher_proc

from _util import require, require_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _shared_data() -> Path:
    """$KVROUTE_SHARED_DATA, else the first ``shared/data`` beside the repository or beside
    one of its parents (a git worktree sits one level deeper than the main checkout)."""
    if "KVROUTE_SHARED_DATA" in os.environ:
        return Path(os.environ["KVROUTE_SHARED_DATA"])
    for d in ROOT.parents:
        if (d / "shared" / "data").is_dir():
            return d / "shared" / "data"
    return ROOT.parent / "shared" / "data"


SHARED_DATA = _shared_data()

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():  # CI has it beside the checkout: a failure, not a skip
        pytest.fail(f"shared data not found at {SHARED_DATA} (set KVROUTE_SHARED_DATA, or put "
                    "it in shared/data beside the checkout)", pytrace=False)
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen3(shared_data: Path) -> Path:
    """The Qwen3 tokenizer directory (tokenizer.json, tokenizer_config.json)."""
    d = shared_data / "tokenizers" / "qwen3"
    require_file(d / "tokenizer.json", "the Qwen3 tokenizer")
    return d


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3: Path):
    """``tokenizers.Tokenizer`` from Qwen3's tokenizer.json (shared: do not reconfigure it)."""
    tokenizers = require("tokenizers")
    return tokenizers.Tokenizer.from_file(str(qwen3 / "tokenizer.json"))


@pytest.fixture(scope="session")
def qwen3_chat_config(qwen3: Path) -> dict:
    """Qwen3's tokenizer_config.json (its chat template and special tokens)."""
    return json.loads((qwen3 / "tokenizer_config.json").read_text("utf-8"))


@pytest.fixture(scope="session")
def mt_bench_questions(shared_data: Path) -> list:
    """mt_bench_question.jsonl: 80 dicts with ``question_id``, ``category``, ``turns``."""
    with open(shared_data / "mt_bench_question.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(autouse=True)
def _no_serve_logging_left_behind():
    """A test that runs ``kvroute serve``'s entry point in this process (``main(["serve",
    ...])``) configures kvroute's loggers for a server (`kvroute.serving.logs.configure`):
    handlers and levels are put back afterwards, so later tests see logging as pytest set it."""
    import logging

    names = ("kvroute", "kvroute.access")
    before = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level)
              for n in names}
    yield
    for n, (handlers, level) in before.items():
        lg = logging.getLogger(n)
        for h in [h for h in lg.handlers if h not in handlers]:
            lg.removeHandler(h)
            h.close()
        lg.setLevel(level)
