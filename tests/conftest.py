"""Shared fixtures: where the real data lives, free loopback ports, a Hypothesis profile."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest helpers (free_port)

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("KVROUTE_SHARED_DATA", ROOT.parent / "shared" / "data"))

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set KVROUTE_SHARED_DATA)")
    return SHARED_DATA


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
