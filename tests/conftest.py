"""Suite-wide settings: one intra-op thread per process (2-core machines), bounded time, a
scratch working directory, and Triton's interpreter where there is no GPU."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# triton.language decorates its own helpers (tl.sum, tl.rand...) when first imported, reading
# TRITON_INTERPRET then: any test module collected before tests/kernels/triton that imports triton
# (torch.utils.flop_counter does) would leave them compiled-only and the interpreted kernels failing
# with "Cannot call @triton.jit'd outside of the scope of a kernel". So it is set before collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests that use the namespace hosts (scripts/cluster). Under pytest-xdist they all run on one
# worker, since the session fixture that brings the hosts up also takes them down at its worker's
# end; every other test file is a unit of its own, so a module-scoped fixture is built once.
CLUSTER_PATHS = ("tests/launcher/runners/ssh/", "tests/launcher/runners/slurm/")


def xdist_scope(nodeid: str) -> str:
    """The unit of work a test belongs to under ``make test``'s two workers."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(CLUSTER_PATHS) or path.endswith("_cluster.py"):
        return "cluster"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduler with ``xdist_scope`` as the scope (its own ``loadgroup`` marks by
    rewriting node ids, which pytest 9.2 no longer reads). Units go out largest first."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileClusterAsOne(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ByFileClusterAsOne(config, log)


def _worker_port_range() -> None:
    """Each pytest-xdist worker draws rendezvous ports from its own slice of the range
    ``free_port`` uses (``DSLAUNCH_PORT_RANGE``, inherited by every process its tests start): two
    workers drawing the same port between one's draw and its bind cost a CI run an EADDRINUSE."""
    from dslaunch.utils import ports

    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or os.environ.get(ports.PORT_RANGE_ENV):
        return
    low, high = ports._draw_range()
    width = (high - low) // count
    start = low + int(worker[2:]) * width
    os.environ[ports.PORT_RANGE_ENV] = f"{start}-{start + width}"


_worker_port_range()


# The checkout's code, compiled once per session. Where PYTHONDONTWRITEBYTECODE is set (as in
# this machine's shells) nothing ever writes it, and every process the suite starts (workers,
# agents, run_world ranks: thousands) compiled dslaunch's ~400 modules from source again: its
# engine's imports took 0.7 s instead of 0.2 s per process at load 12. Python reads the cache
# whatever that variable says, and recompiles a module whose source is newer than its cache.
BYTECODE_DIRS = ("dslaunch", "launcher", "runtime", "kernels", "compat", "tests", "scripts")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the checkout's modules (``__pycache__``, git-ignored) before any test starts a process."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller did, before it started the workers' tests
    import compileall
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for folder in BYTECODE_DIRS:
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=2, workers=1)


@pytest.fixture(autouse=True, scope="session")
def _scratch_cwd():
    """Run the tests (after collection, which needs the checkout) from a scratch directory, so the
    suite leaves nothing in the checkout but Python's bytecode cache; and point the default ``--log_dir`` of the jobs the
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


@pytest.fixture(scope="session")
def deepspeed_python() -> Path:
    """The interpreter of a venv with real DeepSpeed (``DSLAUNCH_DEEPSPEED_PYTHON``, else the one
    ``make conformance`` builds), or skip naming how to get one."""
    named = os.environ.get("DSLAUNCH_DEEPSPEED_PYTHON")
    root = Path(__file__).resolve().parents[1]
    python = Path(named) if named else root / ".venv-conformance" / "deepspeed" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"real DeepSpeed is not installed ({python} is missing): build it with `make conformance` "
                    "or name an interpreter with DSLAUNCH_DEEPSPEED_PYTHON")
    return python


@pytest.fixture
def free_port() -> int:
    from tests.distributed import free_port as _free_port

    return _free_port()


def pytest_report_header(config: pytest.Config) -> str | None:
    """Say so when another program holds the default rendezvous port: test launches take free ports
    (tests/launcher/helpers.py: on_free_port), so it must not matter."""
    from dslaunch.errors import LaunchError
    from dslaunch.launcher.ports import check_port_free

    try:
        check_port_free(29500)
    except (LaunchError, OSError) as err:
        return f"port 29500 is held here (test launches take free ports): {err}"
    return None


# A test's pytest-timeout guards against a hang; it measures no speed (timing promises are the
# tests' own assertions). On a machine busy with other work (load average above its cores: the
# suite took 74 min at load 6-11) a live test runs this much slower, so its guard grows with the
# load when it starts, up to this factor.
MAX_TIMEOUT_SCALE = 4.0


def timeout_scale(load: float, cores: int) -> float:
    """How much longer a test may take than its timeout says, at this 1-minute load average."""
    return max(1.0, min(MAX_TIMEOUT_SCALE, load / max(cores, 1)))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    """pytest-timeout's own timer, with the test's timeout scaled by ``timeout_scale``."""
    import pytest_timeout

    scale = timeout_scale(os.getloadavg()[0], os.cpu_count() or 1)
    if scale == 1.0:
        return None  # the plugin's own, unchanged
    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=settings.timeout * scale))
