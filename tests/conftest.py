"""Suite-wide settings: one intra-op thread per process (2-core machines), bounded time."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def free_port() -> int:
    from tests.distributed import free_port as _free_port

    return _free_port()
