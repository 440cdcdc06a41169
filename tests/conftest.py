"""Suite-wide settings: one intra-op thread per process (2-core machines), bounded time, a
scratch working directory, and Triton's interpreter where there is no GPU."""

import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# triton.language decorates its own helpers (tl.sum, tl.rand...) when first imported, reading
# TRITON_INTERPRET then: any test module collected before tests/kernels/triton that imports triton
# (torch.utils.flop_counter does) would leave them compiled-only and the interpreted kernels failing
# with "Cannot call @triton.jit'd outside of the scope of a kernel". So it is set before collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _scratch_cwd():
    """Run the tests (after collection, which needs the checkout) from a scratch directory, so the
    suite leaves nothing in the checkout; and point the default ``--log_dir`` of the jobs the
    tests launch ($XDG_STATE_HOME/dslaunch/logs) into it, not into the user's own state directory."""
    scratch, before = tempfile.mkdtemp(prefix="dslaunch-tests-"), os.getcwd()
    saved = {k: os.environ.get(k) for k in ("XDG_STATE_HOME", "DSLAUNCH_LOG_DIR")}
    os.environ["XDG_STATE_HOME"] = os.path.join(scratch, "state")
    os.environ.pop("DSLAUNCH_LOG_DIR", None)
    os.chdir(scratch)
    yield
    os.chdir(before)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def free_port() -> int:
    from tests.distributed import free_port as _free_port

    return _free_port()
