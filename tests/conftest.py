"""Suite-wide settings: one intra-op thread per process (2-core machines), bounded time, and a
scratch working directory."""

import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Jobs the tests launch write their default log dir (./dslaunch_logs) under the working directory:
# run from a scratch directory so the suite leaves nothing in the checkout.
_SCRATCH = tempfile.mkdtemp(prefix="dslaunch-tests-")
os.chdir(_SCRATCH)
atexit.register(shutil.rmtree, _SCRATCH, True)


@pytest.fixture
def free_port() -> int:
    from tests.distributed import free_port as _free_port

    return _free_port()
