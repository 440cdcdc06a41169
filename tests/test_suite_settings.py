"""The suite's own settings (tests/conftest.py): a test's hang guard grows with the machine's load."""

import pytest

from tests import conftest


def test_the_timeout_scales_with_the_load_per_core_within_bounds() -> None:
    assert conftest.timeout_scale(0.5, 2) == 1.0  # an idle machine: the timeouts as written
    assert conftest.timeout_scale(6.0, 2) == 3.0  # two CPU hogs and the suite's own processes
    assert conftest.timeout_scale(30.0, 2) == conftest.MAX_TIMEOUT_SCALE
    assert conftest.timeout_scale(3.0, 0) == 3.0  # no core count known: as for one core


def test_pytest_timeout_sets_its_timer_through_the_suites_hook(request: pytest.FixtureRequest) -> None:
    impls = request.config.pluginmanager.hook.pytest_timeout_set_timer.get_hookimpls()
    assert impls[-1].function is conftest.pytest_timeout_set_timer  # tryfirst: called before the plugin's


def test_every_test_file_on_the_namespace_hosts_is_in_the_cluster_unit() -> None:
    """Under ``make test``'s two workers, a file that brings the namespace hosts up (a folder whose
    conftest defines the ``cluster`` or ``slurm`` fixture, or ``locked_hosts``) must share one
    worker with the others: the session fixture of one worker takes the hosts down at its end."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    hosts_fixture = re.compile(r"^def (cluster|slurm)\(", re.M)
    fixture_dirs = [c.parent for c in (root / "tests").rglob("conftest.py") if hosts_fixture.search(c.read_text())]
    on_hosts = [p.relative_to(root).as_posix() for p in sorted((root / "tests").rglob("test_*.py"))
                if p != Path(__file__).resolve()
                and ("locked_hosts(" in p.read_text() or any(d in p.parents for d in fixture_dirs))]
    assert len(fixture_dirs) == 2 and len(on_hosts) >= 10, (fixture_dirs, on_hosts)  # the rule sees them
    assert [p for p in on_hosts if conftest.xdist_scope(f"{p}::test_x") != "cluster"] == []
    assert conftest.xdist_scope("tests/launcher/test_hostfile.py::test_x[a-b]") == "tests/launcher/test_hostfile.py"
