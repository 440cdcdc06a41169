"""Preflight: the checks on probe answers, and real mismatches staged on one cluster host."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from dslaunch.launcher.runners.ssh.preflight import check_probes, diagnose_no_probe
from tests.launcher.runners.ssh.helpers import FAKE, PREFLIGHT_S, Lines

GOOD = {"python": "3.11.7", "implementation": "CPython", "torch": "2.13.0", "executable": "/v/bin/python",
        "master_ip": "10.0.0.1", "master": {"status": "ok"}, "route": {"iface": "eth0"}}


def _probes(**changed) -> dict:
    return {"a": GOOD, "b": GOOD, **{h: {**GOOD, **p} for h, p in changed.items()}}


@pytest.mark.parametrize("change, cause, needle", [
    ({"torch": "2.1.0"}, "version", "torch 2.1.0 here, but a has Python 3.11.7 (CPython), torch 2.13.0"),
    ({"python": "3.10.1"}, "version", "Python 3.10.1"),
    ({"torch": None}, "version", "torch is not installed for /v/bin/python"),
    ({"cwd_error": "No such file or directory"}, "cwd", "/work/x is not usable here"),
    ({"script_missing": "train.py"}, "script", "the user script train.py does not exist here"),
    ({"master": {"status": "unresolvable", "detail": "Name or service not known"}}, "master", "cannot resolve"),
    ({"master": {"status": "unreachable", "detail": "timed out after 2s"}}, "master",
     "cannot reach the master address m (10.0.0.1) port 29500 from here: timed out"),
    ({"master": {"status": "loopback"}, "master_ip": "127.0.0.1"}, "master",
     "the master address m (127.0.0.1) is this host's own loopback here, not the master host; pass --master_addr"),
    ({"master": {"status": "busy"}}, "port", "master port 29500 on m (10.0.0.1) already accepts connections"),
    ({"port": {"free": False, "detail": "--master_port 29500 is already in use"}}, "port", "already in use"),
])
def test_check_probes_names_the_host_and_cause(change, cause, needle):
    problems = check_probes(_probes(c=change), "/work/x", "m", 29500)
    assert list(problems) == ["c"]
    assert problems["c"][0] == cause
    assert needle in problems["c"][1]


def test_all_good_is_no_problem():
    assert check_probes(_probes(), "/w", "m", 29500) == {}


def test_diagnose_no_probe():
    assert diagnose_no_probe("/p/python", 127, "bash: line 1: exec: /p/python: not found")[0] == "interpreter"
    cause, msg = diagnose_no_probe("/p/python", 1, "Traceback...\nModuleNotFoundError: No module named 'dslaunch'")
    assert cause == "interpreter" and "cannot import dslaunch" in msg
    assert diagnose_no_probe("/p/python", None, "")[0] == "timeout"
    assert diagnose_no_probe("/p/python", 255, "", lost=True)[0] == "ssh"


@pytest.fixture
def other_torch_on_last_host(cluster, tmp_path):
    """Make the last host see torch 2.1.0: bind-mount a torch/version.py copy in its sshd's mount
    namespace (``ip netns exec`` gave each sshd a private one), so only that host's sessions see it."""
    import torch

    meta = Path(torch.__file__).parent / "version.py"
    fake = tmp_path / "version.py"
    fake.write_text(re.sub(r"(?m)^__version__ = .*$", "__version__ = '2.1.0'", meta.read_text()))
    pid = str(cluster.sshd_pid(cluster.hosts[-1]))
    subprocess.run(["nsenter", "-t", pid, "-m", "mount", "--bind", str(fake), str(meta)], check=True)
    try:
        yield
    finally:
        subprocess.run(["nsenter", "-t", pid, "-m", "umount", str(meta)], check=True)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_torch_version_mismatch_on_one_host(cluster, other_torch_on_last_host, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE, "print=started"))
    assert run.finish(20) != 0
    err = run.text("err")
    assert re.search(rf"{cluster.hosts[-1]}: Python \S+ \(CPython\), torch 2\.1\.0 here, but "
                     rf"{cluster.hosts[0]} has .*torch 2\.13", err), err
    assert "started" not in run.text("out")
    assert cluster.wait_no_job_processes(3) == {}


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_unreachable_master_addr_is_reported_by_every_host(cluster, free_port):
    start = time.monotonic()
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--master_addr", "10.213.7.99", FAKE))
    assert run.finish(20) != 0
    assert time.monotonic() - start < PREFLIGHT_S
    err = run.text("err")
    for host in cluster.hosts:
        assert re.search(rf"{host}: cannot reach the master address 10\.213\.7\.99 port {free_port}", err), err
    assert cluster.wait_no_job_processes(3) == {}


def test_probe_reports_a_missing_user_script_relative_to_cwd(tmp_path, monkeypatch):
    from dslaunch.launcher.agent import bootstrap

    monkeypatch.chdir(tmp_path)  # probe() chdirs to the job's cwd, like the agent it becomes
    (tmp_path / "train.py").write_text("")
    assert "script_missing" not in bootstrap.probe({"cwd": str(tmp_path), "script": "train.py"})
    found = bootstrap.probe({"cwd": str(tmp_path), "script": "trian.py"})
    assert found["script_missing"] == "trian.py"
    problems = check_probes(_probes(b={"script_missing": "trian.py"}), str(tmp_path), "m", 29500)
    assert list(problems) == ["b"] and "trian.py does not exist here" in problems["b"][1]


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_no_route_answer_that_clears_is_asked_again_and_one_that_stays_is_reported(cluster, free_port):
    """A connect queued on an address resolution that began before a link came back fails with "No
    route to host" though the link is up again (a fresh-clone CI run lost a job to it). Staged with
    an ``unreachable`` route on the second host, which answers exactly that at once."""
    second, master_ip = cluster.hosts[1], cluster.addrs[0]
    blocked = ["ip", "-n", second, "route", "add", "unreachable", f"{master_ip}/32"]
    cleared = ["ip", "-n", second, "route", "del", "unreachable", f"{master_ip}/32"]
    subprocess.run(blocked, check=True)
    try:
        start = time.monotonic()
        run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE, "print=ready"))
        while not any("agent.bootstrap" in p for p in cluster.job_processes(second)):
            assert run.proc.poll() is None and time.monotonic() - start < PREFLIGHT_S, run.text("err")
            time.sleep(0.02)
        time.sleep(1.0)  # its first answer was "No route to host"; the retries go on for 3.5 s
        subprocess.run(cleared, check=True)
        assert run.finish(40) == 0, run.text("err")
        subprocess.run(blocked, check=True)
        start = time.monotonic()
        run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE, "print=ready"))
        assert run.finish(30) != 0
        assert time.monotonic() - start < PREFLIGHT_S
        assert re.search(rf"{second}: cannot reach the master address .*{master_ip}.* port {free_port} from here: "
                         "No route to host", run.text("err")), run.text("err")
    finally:
        subprocess.run(cleared, check=False)
    assert cluster.wait_no_job_processes(3) == {}
