"""The ``neighbour`` fixture: one core kept busy by an unrelated process for a whole test module."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import psutil
import pytest
from busy_neighbour import start_unrelated_spinner


@pytest.fixture(scope="module")
def neighbour() -> Iterator[int]:
    pid = start_unrelated_spinner()
    assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
