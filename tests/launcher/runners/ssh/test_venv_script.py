"""``--venv_script`` on the 3-host test cluster: each host's shell sources it before the node agent
starts (so its environment reaches every rank), a path with shell characters stays one word, and a
script a host cannot source stops the launch in preflight, naming the host and the file."""

from __future__ import annotations

import time

import pytest

from tests.launcher.runners.ssh.helpers import PREFLIGHT_S, Lines

pytestmark = pytest.mark.cluster

_SHOW = ("--no_python", "--no_local_rank", "/bin/sh", "-c", "echo MARK=${DSL_VENV_MARK:-unset}")


def _marks(run: Lines) -> list[str]:
    return sorted(line.split("] ", 1)[1] for _, line in run.out if "MARK=" in line)


@pytest.mark.timeout(60)
def test_every_rank_runs_in_the_sourced_environment(cluster, tmp_path, free_port):
    script = tmp_path / "my env's" / "activate"  # a space and a quote: one shell word all the same
    script.parent.mkdir()
    script.write_text('export DSL_VENV_MARK="sourced on $(ip netns identify)"\n')
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--venv_script", str(script), *_SHOW))
    assert run.finish(30) == 0, run.text("err")
    assert _marks(run) == sorted(f"MARK=sourced on {h}" for h in cluster.hosts for _ in range(2)), run.text("out")
    plain = Lines(cluster.dslaunch("--master_port", str(free_port), *_SHOW))  # the same job without it
    assert plain.finish(30) == 0 and _marks(plain) == ["MARK=unset"] * 6, plain.text("out") + plain.text("err")


@pytest.mark.timeout(60)
def test_a_script_the_hosts_cannot_source_stops_the_launch(cluster, tmp_path, free_port):
    missing = tmp_path / "no-such-activate"
    start = time.monotonic()
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--venv_script", str(missing), *_SHOW))
    code = run.finish(30)
    err = run.text("err")
    assert code != 0 and time.monotonic() - start < PREFLIGHT_S, err
    assert not _marks(run) and err.count(str(missing)) >= len(cluster.hosts), err  # every host names the file
    assert all(h in err for h in cluster.hosts) and "Traceback" not in err, err
