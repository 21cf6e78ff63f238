"""Transitional alias: the encoder moved to `kvroute.wire`."""
from kvroute.wire import *  # noqa: F401,F403
from kvroute.wire import _selfcheck, as_hash, cleared, encode_batch, frames, removed, stored  # noqa: F401
