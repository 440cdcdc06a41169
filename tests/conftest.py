"""Suite-wide settings: one intra-op thread per process (2-core machines), bounded time, and a
scratch working directory."""

import os
import shutil
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _scratch_cwd():
    """Jobs the tests launch write their default log dir (./dslaunch_logs) under the working
    directory: run the tests (after collection, which needs the checkout) from a scratch
    directory, so the suite leaves nothing in the checkout."""
    scratch, before = tempfile.mkdtemp(prefix="dslaunch-tests-"), os.getcwd()
    os.chdir(scratch)
    yield
    os.chdir(before)
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def free_port() -> int:
    from tests.distributed import free_port as _free_port

    return _free_port()
