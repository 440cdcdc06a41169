"""MonitorMaster off the training thread, rank 0 only, and a failing backend that does not stop
training; the CSV monitor's repair of a torn file."""

from __future__ import annotations

import threading
import time

import pytest

from dslaunch.monitor.config import CSVConfig, DeepSpeedMonitorConfig
from dslaunch.monitor.csv_monitor import csvMonitor
from dslaunch.monitor.monitor import Monitor, MonitorMaster

pytestmark = pytest.mark.timeout(30)


class _Slow(Monitor):
    def __init__(self, fail: bool = False) -> None:
        super().__init__(None)
        self.fail, self.rows, self.threads = fail, [], set()

    def write_events(self, event_list) -> None:
        self.threads.add(threading.current_thread().name)
        time.sleep(0.2)
        if self.fail:
            raise OSError(28, "No space left on device")
        self.rows += event_list


def _master(rank: int, backend: Monitor) -> MonitorMaster:
    master = MonitorMaster(DeepSpeedMonitorConfig(csv_monitor=CSVConfig(enabled=True, output_path="/nonexistent")),
                           rank=rank)
    if master.backends:
        master.backends = [backend]
    return master


def test_writes_happen_on_the_writer_thread_and_write_events_does_not_wait() -> None:
    backend = _Slow()
    master = _master(0, backend)
    start = time.perf_counter()
    for step in range(5):
        master.write_events([("Train/Samples/lr", 0.1, step)])
    assert time.perf_counter() - start < 0.1  # 5 writes of 0.2 s each were queued, not run
    master.flush()
    assert backend.rows == [("Train/Samples/lr", 0.1, s) for s in range(5)]
    assert backend.threads == {"dslaunch-monitor"}
    master.close()


def test_only_rank_0_has_backends() -> None:
    master = _master(1, _Slow())
    assert master.enabled and master.backends == []
    master.write_events([("x", 1.0, 1)])  # a no-op
    master.flush()


def test_a_failing_backend_warns_once_and_training_goes_on(capsys) -> None:
    master = _master(0, _Slow(fail=True))
    master.write_events([("x", 1.0, 1)])
    master.flush()
    master.write_events([("x", 1.0, 2)])
    master.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and "writes nothing more" in err


def test_csv_resume_drops_a_torn_row_and_later_rows_and_keeps_one_header(tmp_path) -> None:
    run = tmp_path / "job"
    run.mkdir()
    (run / "Train_Samples_lr.csv").write_text("step,lr\r\n2,0.1\r\n4,0.2\r\n6,0.3\r\n8,0.")
    mon = csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path), job_name="job"))
    mon.start_at(4)  # the checkpoint the run resumed from was taken at 4 samples
    mon.write_events([("Train/Samples/lr", 0.25, 6), ("Train/Samples/lr", 0.35, 8)])
    mon.close()
    assert (run / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "2,0.1", "4,0.2", "6,0.25",
                                                                      "8,0.35"]
    fresh = csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path), job_name="job"))
    fresh.write_events([("Train/Samples/lr", 0.45, 10)])  # no start_at (a script's own monitor): append
    fresh.close()
    assert (run / "Train_Samples_lr.csv").read_text().splitlines()[-2:] == ["8,0.35", "10,0.45"]


def test_events_queued_when_the_process_exits_are_written(tmp_path) -> None:
    # The script neither flushes nor closes, and exits well within the writer's 0.5 s interval.
    import subprocess
    import sys

    script = ("from dslaunch.monitor.config import CSVConfig, DeepSpeedMonitorConfig\n"
              "from dslaunch.monitor.monitor import MonitorMaster\n"
              f"m = MonitorMaster(DeepSpeedMonitorConfig(csv_monitor=CSVConfig(enabled=True, output_path={str(tmp_path)!r},"
              " job_name='run')), rank=0)\n"
              "m.write_events([('Train/Samples/lr', 0.5, s) for s in (1, 2, 3)])\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=25)
    with open(tmp_path / "run" / "Train_Samples_lr.csv") as f:
        assert f.read().splitlines() == ["step,lr", "1,0.5", "2,0.5", "3,0.5"]
