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
