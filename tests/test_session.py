"""session_key: the vLLM router's lookup order (headers, body), then a prompt-prefix hash."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.session import SESSION_HEADERS, prefix_hash, session_key


def blake(ids) -> str:
    return hashlib.blake2b(np.asarray(ids, dtype="<u4").tobytes(), digest_size=8).hexdigest()


# -- headers -----------------------------------------------------------------------------------

def test_header_order_follows_the_vllm_router():
    assert SESSION_HEADERS == ("x-session-id", "x-user-id", "x-tenant-id", "x-correlation-id",
                               "x-request-id", "x-trace-id")
    all_set = {h: f"v-{h}" for h in SESSION_HEADERS}
    for h in SESSION_HEADERS:
        assert session_key(all_set, None) == f"v-{h}"
        del all_set[h]  # the next one in line wins once this one is gone
    assert session_key(all_set, None) == ""


@pytest.mark.parametrize("name", ["X-Session-Id", "X-SESSION-ID", "x-session-id", "x-Session-ID"])
def test_headers_are_case_insensitive(name):
    assert session_key({name: "s1", "X-User-Id": "u1"}, None) == "s1"


def test_empty_header_values_are_skipped():
    assert session_key({"x-session-id": "", "x-user-id": "  ", "x-tenant-id": "t"}, None) == "t"
    # an empty first spelling does not hide a non-empty second one
    assert session_key({"x-session-id": "", "X-Session-Id": "s"}, None) == "s"


def test_header_values_are_stripped_and_bytes_decoded():
    assert session_key({"x-user-id": "  alice \t"}, None) == "alice"
    assert session_key({b"X-Request-Id": b"req-7"}, None) == "req-7"


def test_unrelated_headers_are_ignored():
    assert session_key({"authorization": "Bearer x", "x-custom": "y"}, None) == ""


def test_headers_win_over_body_and_tokens():
    body = {"session_params": {"session_id": "b"}, "user": "u"}
    assert session_key({"x-trace-id": "h"}, body, [1, 2, 3]) == "h"


# -- body --------------------------------------------------------------------------------------

def test_body_order():
    body = {"user_id": "uid", "session_id": "s", "user": "u",
            "session_params": {"session_id": "sp"}}
    assert session_key({}, body, [1, 2]) == "sp"
    del body["session_params"]
    assert session_key({}, body, [1, 2]) == "u"
    del body["user"]
    assert session_key({}, body, [1, 2]) == "s"
    del body["session_id"]
    assert session_key({}, body, [1, 2]) == "uid"
    del body["user_id"]
    assert session_key({}, body) == ""


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"user": 42}, "42"),
        ({"user_id": 0}, "0"),
        ({"session_id": np.int64(7)}, "7"),
        ({"user": True, "session_id": "s"}, "s"),  # booleans are not identifiers
        ({"user": "", "session_id": "s"}, "s"),
        ({"user": None, "user_id": "x"}, "x"),
        ({"user": 1.5, "user_id": "x"}, "x"),  # floats are not identifiers
        ({"user": ["a"], "user_id": "x"}, "x"),
        ({"session_params": "not-a-mapping", "user": "u"}, "u"),
        ({"session_params": {"session_id": ""}, "user": "u"}, "u"),
        ({"session_params": {"other": "x"}}, ""),
        ({"messages": [{"role": "user", "content": "hi"}]}, ""),
    ],
)
def test_body_fields(body, expected):
    assert session_key(None, body) == expected


# -- prompt prefix -----------------------------------------------------------------------------

def test_token_fallback_is_blake2b_of_the_prefix():
    toks = list(range(1000))
    assert session_key(None, None, toks) == blake(toks[:256])
    assert session_key(None, None, toks, prefix_tokens=16) == blake(toks[:16])
    assert len(session_key(None, None, toks)) == 16
    assert session_key(None, None, [5]) == blake([5])


@pytest.mark.parametrize("dtype", [np.uint32, np.int32, np.int64, np.uint64, np.uint16])
def test_container_and_dtype_do_not_matter(dtype):
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    assert session_key({}, {}, np.asarray(toks, dtype=dtype)) == session_key({}, {}, toks)
    assert session_key({}, {}, tuple(toks)) == session_key({}, {}, toks)


def test_only_the_prefix_counts():
    base = list(range(300))
    same_prefix = base[:256] + [7] * 50
    other_prefix = [9] + base[1:]
    assert session_key(None, None, same_prefix) == session_key(None, None, base)
    assert session_key(None, None, other_prefix) != session_key(None, None, base)
    # a shorter prompt is a different key from its extension within the prefix window
    assert session_key(None, None, base[:100]) != session_key(None, None, base[:101])


def test_nothing_gives_empty():
    assert session_key(None, None) == ""
    assert session_key({}, {}, []) == ""
    assert session_key({}, {}, np.empty(0, dtype=np.uint32)) == ""


@pytest.mark.parametrize(
    "tokens, match",
    [
        ([1.0, 2.0], "integer"),
        (np.array([1.5]), "integer"),
        ([True, False], "integer"),
        ([-1, 2], r"\[0, 2\*\*32\)"),
        ([1 << 32], r"\[0, 2\*\*32\)"),
        ([1 << 70], r"\[0, 2\*\*32\)"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
        ("hello", "not text"),
    ],
)
def test_bad_tokens(tokens, match):
    with pytest.raises(ValueError, match=match):
        session_key(None, None, tokens)


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_bad_prefix_tokens(n):
    with pytest.raises(ValueError, match="prefix_tokens"):
        session_key(None, None, [1, 2], prefix_tokens=n)


def test_explicit_ids_do_not_need_valid_tokens():
    # the token fallback is not evaluated when an id is present
    assert session_key({"x-session-id": "s"}, None, [1.5]) == "s"


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
       st.lists(st.integers(0, 2**32 - 1), max_size=10),
       st.integers(1, 40))
def test_prefix_hash_depends_only_on_the_prefix(toks, tail, n):
    key = prefix_hash(toks, n)
    assert key == blake(toks[:n])
    if len(toks) >= n:
        assert prefix_hash(toks + tail, n) == key
    assert prefix_hash(np.asarray(toks, dtype=np.uint32), n) == key
