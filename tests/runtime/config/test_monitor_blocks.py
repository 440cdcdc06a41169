"""The ``tensorboard``, ``csv_monitor``, ``wandb``, ``comet`` and ``comms_logger`` blocks: DeepSpeed's
keys and defaults, one line naming the key for a bad value, a typo or a missing package."""

from __future__ import annotations

import importlib.util

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config


def _error(raw: dict) -> str:
    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 8, **raw}, 2)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_deepspeeds_defaults() -> None:
    cfg = load_config({"train_batch_size": 8, "tensorboard": {"enabled": True}, "comms_logger": {"enabled": True}}, 2)
    mon = cfg.monitor_config
    assert mon.enabled and (mon.tensorboard.output_path, mon.tensorboard.job_name) == ("", "DeepSpeedJobName")
    assert (mon.csv_monitor.enabled, mon.wandb.project, mon.comet.samples_log_interval) == (False, "deepspeed", 100)
    log = cfg.comms_logger
    assert (log.enabled, log.verbose, log.prof_all, log.debug, log.prof_ops) == (True, False, True, False, ())
    assert not load_config({"train_batch_size": 8}, 2).monitor_config.enabled


@pytest.mark.parametrize("raw, start", [
    ({"tensorboard": {"enabled": "yes"}}, "'tensorboard.enabled': "),
    ({"csv_monitor": {"enabled": True, "job_name": "a/b"}}, "'csv_monitor.job_name': must be a non-empty name"),
    ({"csv_monitor": {"output_pth": "x"}}, "'csv_monitor.output_pth': "),
    ({"comet": {"samples_log_interval": -1}}, "'comet.samples_log_interval': "),
    ({"comet": {"mode": "append"}}, "'comet.mode': "),
    ({"comms_logger": {"prof_ops": ["allreduce"]}}, "'comms_logger.prof_ops[0]': unknown operation 'allreduce' "
                                                    "(did you mean 'all_reduce'?)"),
    ({"comms_logger": {"prof_ops": "all_reduce"}}, "'comms_logger.prof_ops': must be a list"),
])
def test_bad_values_name_the_key(raw: dict, start: str) -> None:
    assert _error(raw).startswith(start)


def test_a_typo_gets_a_suggestion() -> None:
    assert "did you mean 'output_path'" in _error({"csv_monitor": {"output_pth": "x"}})


def test_a_missing_package_is_one_line_naming_it(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "comet_ml" else real(name, *a))
    msg = _error({"comet": {"enabled": True}})
    assert msg.startswith("'comet.enabled': true needs the 'comet-ml' package") and "pip install comet-ml" in msg
    load_config({"train_batch_size": 8, "comet": {"enabled": False}}, 2)  # off: not needed
