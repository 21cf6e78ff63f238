"""CurveZMQ on the event path (cpp/events/README.md, "Threat model"): real pyzmq publishers
over loopback, the router's SUB socket a CURVE client (connected workers, ``curve_server_key``)
or a CURVE server (bound workers, ``curve_secret_key``, ``curve_allowed_publisher_keys``).
The right keys get events through; a wrong or absent key gets nothing, and the router keeps
serving its other workers."""

from __future__ import annotations

import time

import pytest
import zmq
from _util import await_first_batch, free_port, toks, wait_for

import kvroute.wire as ee
from kvroute import Router, Worker, _core
from kvroute.config import ConfigError, load_config

# CI's libzmq (Debian's libzmq3-dev, built with libsodium) and pyzmq's wheels have CURVE: a
# build without it is a broken environment, not an optional dependency.
if not (zmq.has("curve") and _core.curve_available()):
    pytest.fail(f"libzmq without CURVE (pyzmq: {zmq.has('curve')}, kvroute._core: "
                f"{_core.curve_available()}); scripts/setup.sh installs a libzmq with it",
                pytrace=False)

BS = 16
EMPTY = ee.encode_batch([], era="array")


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def keypair() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def curve_server_pub(ctx, secret: str, public: str):
    """A PUB socket that is a CURVE server, bound to an OS-chosen loopback port."""
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.curve_secretkey = secret.encode()
    pub.curve_publickey = public.encode()
    pub.curve_server = True
    pub.bind("tcp://127.0.0.1:0")
    return pub, pub.getsockopt_string(zmq.LAST_ENDPOINT)


def connecting_pub(ctx, ep: str, server_key: str | None, keys: tuple[str, str] | None = None):
    """A PUB socket connecting to a bound SUB: a CURVE client of ``server_key`` (own key
    pair ``keys`` or a fresh one), or NULL when ``server_key`` is None."""
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = keys or keypair()
        pub.curve_serverkey = server_key.encode()
        pub.curve_publickey = public.encode()
        pub.curve_secretkey = secret.encode()
    pub.connect(ep)
    return pub


def stored_payload(first: int) -> bytes:
    return ee.encode_batch([ee.stored([first], None, toks(BS, first), BS)], era="array")


def sends_get_nothing(router: Router, name: str, send, seconds: float = 0.8) -> None:
    """Sends for ``seconds``; the worker must receive no batch."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        send()
        time.sleep(0.02)
    assert router.stats()["workers"][name]["batches"] == 0


def test_keys_are_validated_with_clear_errors():
    public, secret = keypair()
    with pytest.raises(ValueError, match="curve_secret_key must be a 40-character Z85"):
        Router([Worker("w")], curve_secret_key="short")
    with pytest.raises(ValueError, match=r"curve_allowed_publisher_keys\[1\] must be a "
                                         r"40-character Z85 CurveZMQ key, got '~'"):
        Router([Worker("w")], curve_secret_key=secret,
               curve_allowed_publisher_keys=[public, "~" * 40])
    with pytest.raises(ValueError, match="curve_allowed_publisher_keys must be a list"):
        Router([Worker("w")], curve_secret_key=secret, curve_allowed_publisher_keys=public)
    with pytest.raises(ValueError, match="needs curve_secret_key"):
        Router([Worker("w")], curve_allowed_publisher_keys=[public])
    with pytest.raises(ValueError, match="curve_server_key must be a 40-character Z85"):
        Router([Worker("w", kv_endpoint="tcp://127.0.0.1:5557", curve_server_key=public[:39])])
    with pytest.raises(ValueError, match="is for a connected kv_endpoint"):
        Router([Worker("w", kv_endpoint="tcp://127.0.0.1:5557", bind=True,
                       curve_server_key=public)])
    router = Router([Worker("w")], curve_secret_key=secret)
    try:
        assert router.curve_public_key == public
        with pytest.raises(ValueError, match="curve_server_key must be a 40-character Z85"):
            router.add_worker(Worker("x", kv_endpoint="tcp://127.0.0.1:5557",
                                     curve_server_key="x" * 41))
    finally:
        router.close()
    assert Router([Worker("w")]).curve_public_key is None


def test_connected_worker_with_the_publishers_key_gets_its_events(ctx):
    public, secret = keypair()
    pub, ep = curve_server_pub(ctx, secret, public)
    try:
        for router_secret in (None, keypair()[1]):  # its own key pair, or one made for it
            router = Router([Worker("w", kv_endpoint=ep, curve_server_key=public)],
                            block_size=BS, curve_secret_key=router_secret)
            try:
                await_first_batch(router, "w", lambda: pub.send_multipart(
                    ee.frames(b"kv", 0, EMPTY)))
                pub.send_multipart(ee.frames(b"kv", 1, stored_payload(100)))
                wait_for(lambda r=router: r.find_matches(toks(BS, 100))["w"].blocks == 1,
                         what="the stored block indexed")
            finally:
                router.close()
    finally:
        pub.close(0)


def test_connected_worker_with_a_wrong_or_absent_key_gets_nothing(ctx):
    public, secret = keypair()
    pub, ep = curve_server_pub(ctx, secret, public)
    healthy = ctx.socket(zmq.PUB)
    healthy.setsockopt(zmq.LINGER, 0)
    healthy.bind("tcp://127.0.0.1:0")
    hep = healthy.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        router = Router([Worker("wrong", kv_endpoint=ep, curve_server_key=keypair()[0]),
                         Worker("absent", kv_endpoint=ep),
                         Worker("healthy", kv_endpoint=hep)], block_size=BS)
        try:
            await_first_batch(router, "healthy", lambda: healthy.send_multipart(
                ee.frames(b"kv", 0, EMPTY)))
            sends_get_nothing(router, "wrong",
                              lambda: pub.send_multipart(ee.frames(b"kv", 0, stored_payload(7))))
            s = router.stats()["workers"]
            assert s["absent"]["batches"] == 0
            assert s["wrong"]["reconnects"] == 0 and s["wrong"]["resets"] == 0
            # The router goes on: the healthy worker's events, decisions, a removal.
            healthy.send_multipart(ee.frames(b"kv", 1, stored_payload(300)))
            wait_for(lambda: router.find_matches(toks(BS, 300))["healthy"].blocks == 1,
                     what="the healthy worker's block indexed")
            assert router.select_worker(toks(BS, 300)).worker == "healthy"
            t0 = time.perf_counter()
            router.remove_worker("wrong")
            assert time.perf_counter() - t0 < 1.0
        finally:
            t0 = time.perf_counter()
            router.close()
            assert time.perf_counter() - t0 < 1.0
    finally:
        pub.close(0)
        healthy.close(0)


def bound_router(secret: str, allowed=None) -> tuple[Router, str]:
    ep = f"tcp://127.0.0.1:{free_port()}"
    router = Router([Worker("w", kv_endpoint=ep, bind=True)], block_size=BS,
                    curve_secret_key=secret, curve_allowed_publisher_keys=allowed)
    return router, ep


def test_bound_worker_accepts_publishers_that_know_the_routers_key(ctx):
    public, secret = keypair()
    router, ep = bound_router(secret)
    try:
        pub = connecting_pub(ctx, ep, router.curve_public_key)
        assert router.curve_public_key == public
        await_first_batch(router, "w", lambda: pub.send_multipart(ee.frames(b"kv", 0, EMPTY)))
        pub.close(0)
    finally:
        router.close()
    router, ep = bound_router(secret)
    try:
        wrong = connecting_pub(ctx, ep, keypair()[0])  # another server key
        null = connecting_pub(ctx, ep, None)  # no CURVE at all
        sends_get_nothing(router, "w", lambda: [p.send_multipart(ee.frames(b"kv", 0, EMPTY))
                                               for p in (wrong, null)])
        wrong.close(0)
        null.close(0)
        s = router.stats()["workers"]["w"]
        assert s["reconnects"] == 0 and s["resets"] == 0
        # The right key still gets in afterwards.
        pub = connecting_pub(ctx, ep, public)
        await_first_batch(router, "w", lambda: pub.send_multipart(ee.frames(b"kv", 0, EMPTY)))
        pub.close(0)
    finally:
        router.close()


def test_bound_worker_with_allowed_publisher_keys_refuses_other_keys(ctx):
    public, secret = keypair()
    allowed = keypair()
    router, ep = bound_router(secret, allowed=[allowed[0]])
    try:
        other = connecting_pub(ctx, ep, public)  # knows the router's key, not on the list
        sends_get_nothing(router, "w",
                          lambda: other.send_multipart(ee.frames(b"kv", 0, stored_payload(5))))
        other.close(0)
        pub = connecting_pub(ctx, ep, public, keys=allowed)
        await_first_batch(router, "w", lambda: pub.send_multipart(ee.frames(b"kv", 0, EMPTY)))
        pub.send_multipart(ee.frames(b"kv", 1, stored_payload(40)))
        wait_for(lambda: router.find_matches(toks(BS, 40))["w"].blocks == 1,
                 what="the allowed publisher's block indexed")
        pub.close(0)
    finally:
        router.close()


def test_config_keys_reach_the_router():
    public, secret = keypair()
    cfg = load_config({
        "mode": {"type": "regular", "workers": [
            {"url": "http://a:8000", "kv_events": "tcp://127.0.0.1:5557",
             "curve_server_key": public}]},
        "kv_events": {"curve_secret_key": secret, "curve_allowed_publisher_keys": [public]},
    })
    kw = cfg.router_kwargs()
    assert kw["curve_secret_key"] == secret and kw["curve_allowed_publisher_keys"] == [public]
    assert cfg.workers()[0].curve_server_key == public
    with pytest.raises(ConfigError, match="curve_server_key must be a 40-character Z85"):
        load_config({"mode": {"type": "regular", "workers": [
            {"url": "http://a:8000", "kv_events": "tcp://127.0.0.1:5557",
             "curve_server_key": "nope"}]}})
    with pytest.raises(ConfigError, match="curve_server_key is for a connected"):
        load_config({"mode": {"type": "regular", "workers": [
            {"url": "http://a:8000", "kv_events": "tcp://127.0.0.1:5557", "bind": True,
             "curve_server_key": public}]}})
    with pytest.raises(ConfigError, match="needs curve_secret_key"):
        load_config({"mode": {"type": "regular", "workers": ["http://a:8000"]},
                     "kv_events": {"curve_allowed_publisher_keys": [public]}})


def test_bound_worker_checks_address_and_key_together(ctx):
    public, secret = keypair()
    allowed = keypair()
    ep = f"tcp://127.0.0.1:{free_port()}"
    router = Router([Worker("w", kv_endpoint=ep, bind=True)], block_size=BS,
                    curve_secret_key=secret, curve_allowed_publisher_keys=[allowed[0]],
                    allowed_publisher_ips=["10.1.2.3"])
    try:
        pub = connecting_pub(ctx, ep, public, keys=allowed)  # the right key, another address
        sends_get_nothing(router, "w", lambda: pub.send_multipart(ee.frames(b"kv", 0, EMPTY)))
        pub.close(0)
    finally:
        router.close()
