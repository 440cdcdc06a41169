"""dslaunch.init_distributed: backend choice, collective timeout sources, when it does nothing.

Most tests record the arguments ``init_process_group`` gets (no process group is created in the
pytest process); one test initialises a real 2-rank gloo group and reads the timeout it applied.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os

import pytest
import torch
import torch.distributed as dist

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime import dist as ds_dist
from dslaunch.runtime.config import load_config
from tests.distributed import run_world


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The init_process_group calls made; a clean single-process environment without CUDA."""
    seen: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.append({"backend": backend, **kw}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", ds_dist.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    # init_distributed fills these in with setdefault: set them so monkeypatch restores them.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    return seen


def _seconds(call: dict) -> float:
    return call["timeout"].total_seconds()


@pytest.mark.timeout(30)
def test_gloo_without_cuda_as_a_world_of_one(calls: list[dict]) -> None:
    ds_dist.init_distributed(verbose=False)
    assert len(calls) == 1
    assert (calls[0]["backend"], calls[0]["rank"], calls[0]["world_size"]) == ("gloo", 0, 1)
    assert _seconds(calls[0]) == 1800  # DeepSpeed's default, passed explicitly


@pytest.mark.timeout(30)
def test_nccl_with_cuda_unless_a_backend_is_given(calls: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    ds_dist.init_distributed(verbose=False)
    ds_dist.init_distributed(dist_backend="gloo", verbose=False)
    assert [c["backend"] for c in calls] == ["nccl", "gloo"]
    assert devices == [torch.device("cuda", 1)]  # the GPU of this local rank, for nccl only
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UsageError, match=r"^LOCAL_RANK=1 but this process sees 1 GPU: start at most one rank"):
        ds_dist.init_distributed(verbose=False)
    assert len(calls) == 2  # refused before any process group


@pytest.mark.timeout(30)
def test_timeout_from_argument_env_config_or_default(calls: list[dict], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config({"train_batch_size": 1, "dist_init_timeout": 60}, 1)
    ds_dist.init_distributed(verbose=False)
    ds_dist.init_distributed(verbose=False, config=cfg)
    ds_dist.init_distributed(verbose=False, config={"train_batch_size": 1, "dist_init_timeout": 45})
    ds_dist.init_distributed(verbose=False, config={"train_batch_size": 1})  # dict without the key
    monkeypatch.setenv(ds_dist.TIMEOUT_ENV, "90")
    ds_dist.init_distributed(verbose=False, config=cfg)  # the environment beats the config
    ds_dist.init_distributed(verbose=False, config=cfg, timeout=datetime.timedelta(seconds=7))
    assert [_seconds(c) for c in calls] == [1800, 60, 45, 1800, 90, 7]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw", ["soon", "-5", "0", "inf"])
def test_bad_timeout_env_is_one_clear_error(calls: list[dict], monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(ds_dist.TIMEOUT_ENV, raw)
    with pytest.raises(UsageError, match=f"DSLAUNCH_DIST_TIMEOUT='{raw}' is not a number of seconds > 0"):
        ds_dist.init_distributed(verbose=False)
    assert calls == []  # nothing started


@pytest.mark.timeout(30)
def test_bad_timeout_in_a_dict_config_names_the_key(calls: list[dict]) -> None:
    with pytest.raises(ConfigError, match=r"'dist_init_timeout': must be in \(0, 1e8\], got int -1"):
        ds_dist.init_distributed(verbose=False, config={"dist_init_timeout": -1})
    assert calls == []


@pytest.mark.timeout(30)
def test_nothing_when_not_required_or_already_initialised(calls: list[dict],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ds_dist.init_distributed(dist_init_required=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    ds_dist.init_distributed()
    assert calls == []


def _real_group(rank: int, world: int) -> dict:
    os.environ[ds_dist.TIMEOUT_ENV] = "120"
    import dslaunch

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        dslaunch.init_distributed()
        dslaunch.init_distributed()  # already initialised: a no-op
    backend = dist.get_backend()
    group = dist.distributed_c10d._get_default_group()  # private: what the group really applies
    applied = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"backend": backend, "world": dist.get_world_size(), "rank": dist.get_rank(),
            "timeout": applied, "sum": total.item(), "printed": printed.getvalue()}


@pytest.mark.timeout(60)
@pytest.mark.skipif(0 < torch.cuda.device_count() < 2, reason="two NCCL ranks need two GPUs")
def test_real_two_rank_group_uses_the_env_timeout() -> None:
    out = run_world(_real_group, 2)
    for rank, o in enumerate(out):
        assert (o["backend"], o["world"], o["rank"]) == ("gloo", 2, rank)
        assert o["timeout"] == 120 and o["sum"] == 2
    assert out[0]["printed"].count("initialized gloo process group: world_size=2, timeout=120s") == 1
    assert out[1]["printed"] == ""  # rank 0 reports


@pytest.mark.parametrize("raw", ["1e300", "inf", "nan", "0", "-5", "x" * 5000])
def test_env_timeout_out_of_range_is_one_bounded_line(monkeypatch, raw) -> None:
    monkeypatch.setenv("DSLAUNCH_DIST_TIMEOUT", raw)
    with pytest.raises(UsageError, match=r"^DSLAUNCH_DIST_TIMEOUT=.* is not a number of seconds > 0 \(at most 1e\+08\)$") as err:
        ds_dist.default_timeout()
    assert len(str(err.value)) < 200


def test_dict_config_timeout_beyond_the_range_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dist_init_timeout"):
        ds_dist.init_distributed(config={"dist_init_timeout": 1e300})


_ALONE = """
import os, psutil, torch, torch.distributed as dist
import dslaunch
dslaunch.init_distributed(verbose=False)
port = int(os.environ["MASTER_PORT"])
listening = [c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
t = torch.ones(2)
dist.all_reduce(t, group=dist.new_group([0]))
print(type(store).__name__, port in listening, t.tolist(), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("port_given", [False, True])
def test_a_world_of_one_without_a_port_listens_on_none(port_given: bool) -> None:
    import subprocess
    import sys

    from dslaunch.utils.ports import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if port_given:  # the user's rendezvous is honoured as before: env://, a TCPStore on the port
        env["MASTER_PORT"] = str(free_port())
    out = subprocess.run([sys.executable, "-c", _ALONE], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    store, listens, total = out.stdout.split(" ", 2)
    assert (store, listens) == (("TCPStore", "True") if port_given else ("HashStore", "False"))
    assert total.strip() == "[1.0, 1.0]"  # a collective on a subgroup still works


_TAGGED_RANK = """
import os, torch, torch.distributed as dist
import dslaunch
from dslaunch.errors import UsageError
try:
    dslaunch.init_distributed(verbose=False)
except UsageError as err:
    print("REFUSED", err, flush=True)
    os._exit(3)
t = torch.tensor([float(os.environ["TAG"])])
dist.all_reduce(t)
print("SUM", t.item(), flush=True)
os._exit(0)
"""


def _rank_of(job: str, rank: int, port: int):
    import subprocess
    import sys

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
           "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "DSLAUNCH_RENDEZVOUS_ID": f"{job}/0",
           "TAG": "1" if job == "job-a" else "100", "DSLAUNCH_DIST_TIMEOUT": "60"}
    return subprocess.Popen([sys.executable, "-c", _TAGGED_RANK], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _listening(port: int, deadline: float) -> None:
    import socket
    import time

    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


@pytest.mark.timeout(120)
def test_a_rank_of_another_job_on_the_same_port_is_refused_and_the_job_there_is_unharmed() -> None:
    import time

    from dslaunch.utils.ports import free_port

    port = free_port()
    a0 = _rank_of("job-a", 0, port)
    try:
        _listening(port, time.monotonic() + 60)
        b1 = _rank_of("job-b", 1, port)  # the other job's rank 1, joining job A's store
        out_b1, _ = b1.communicate(timeout=60)
        b0 = _rank_of("job-b", 0, port)  # the other job's rank 0: the port is job A's
        out_b0, _ = b0.communicate(timeout=60)
        a1 = _rank_of("job-a", 1, port)
        out_a1, _ = a1.communicate(timeout=60)
        out_a0, _ = a0.communicate(timeout=60)
    finally:
        a0.kill()
    assert b1.returncode == 3, out_b1[-2000:]
    assert f"REFUSED 127.0.0.1:{port} is the rendezvous of another dslaunch job ('job-a/0'), not of this one " \
           "(job-b/0): two jobs share the port; give each its own --master_port" in out_b1
    assert b0.returncode == 3 and f"REFUSED MASTER_PORT {port} is already in use on this host" in out_b0, out_b0[-2000:]
    assert (a0.returncode, a1.returncode) == (0, 0), (out_a0[-2000:], out_a1[-2000:])
    assert "SUM 2.0" in out_a0 and "SUM 2.0" in out_a1  # job A's world is its own two ranks
