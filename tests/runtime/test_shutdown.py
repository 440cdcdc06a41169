"""Every exit path of a worker frees its process groups before Python finalizes (runtime/shutdown.py).

A gloo group still alive at finalization can abort the process (SIGABRT, exit 134) after the job
finished; how often depends on scheduling. What is deterministic, and checked here, is the cause:
whether any gloo thread is still running when the interpreter starts to finalize. A probe
registered before dslaunch is imported runs as the very last atexit handler and lists them.
"""

import subprocess
import sys

import pytest

from dslaunch.runtime.shutdown import FAILING_EXIT_BOUND_S

PROBE = """
import atexit, gc, os
def _gloo_threads_at_exit():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(f"gloo threads at exit: {sorted(n for n in names if 'gloo' in n)}", flush=True)
    print(f"frozen at exit: {gc.get_freeze_count() > 0}", flush=True)
atexit.register(_gloo_threads_at_exit)
"""

# A DeepSpeed-style script: ZeRO-2 with overlapped parameter gathers still in flight after the last
# step, no destroy_process_group(). The wrapper reports, at the moment the group is destroyed,
# whether any gather was still pending.
SCRIPT = PROBE + """
import sys
if sys.argv[1] == "files":
    sys.modules["triton"] = None  # as with torch's CPU wheels: no triton (nanobind) in the process
import torch
import torch.distributed as dist
import dslaunch as deepspeed

mode = sys.argv[1]
engine_box = []
original = dist.destroy_process_group
def destroy(*args, **kwargs):
    pending = len(engine_box[0].zero.publisher._works) if engine_box else 0
    print(f"destroy_process_group pending={pending}", flush=True)
    return original(*args, **kwargs)
dist.destroy_process_group = destroy

if mode == "init_only":
    deepspeed.init_distributed()
    t = torch.ones(4)
    dist.all_reduce(t)
    torch.optim.AdamW([torch.nn.Parameter(t)])  # imports what binds the default group
    sys.exit(0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
config = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2, "overlap_comm": True, "overlap_param_gather": True,
                                "reduce_bucket_size": 4000,
                                "allgather_bucket_size": 2000}}
if mode == "ok":  # gloo: its publish leaves broadcasts in flight; the shared-memory one is synchronous
    config["shared_memory_collectives"] = "never"
engine, *_ = deepspeed.initialize(model=model, config=config)
engine_box.append(engine)
for _ in range(3):
    loss = engine(torch.randn(4, 64)).square().mean()
    engine.backward(loss)
    engine.step()
print(f"in flight after the last step: {len(engine.zero.publisher._works) > 0}", flush=True)
if mode == "checkpoint":
    engine.save_checkpoint(sys.argv[2])  # builds dslaunch's private checkpoint group
elif mode == "user_destroys":
    engine.destroy()
    dist.destroy_process_group()
elif mode == "exit3":
    sys.exit(3)
elif mode == "files":
    class Log:
        def __init__(self, path):
            self.file = open(path, "w")  # buffered, never closed
            self.me = self  # a cycle: only a garbage collection would close the file
    log = Log(f"{sys.argv[2]}/rank{engine.global_rank}.log")
    log.file.write("the last line\\n")
    engine.save_checkpoint(f"{sys.argv[2]}/ckpt")
    sys.exit(3)
elif mode == "raise":
    raise RuntimeError("user error after training")
elif mode == "interrupt":
    raise KeyboardInterrupt
elif mode == "stuck_peer":
    if engine.global_rank == 0:
        import time
        time.sleep(60)  # never joins the collective below: rank 1 must not wait for it at exit
    dist.all_reduce(torch.ones(4), async_op=True)
    raise RuntimeError("failed with a collective in flight")
"""


def _launch(tmp_path, port: int, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "--num_gpus", "2",
                           "--master_port", str(port), "--no_local_rank", str(script), *args],
                          capture_output=True, text=True, timeout=90)


def _assert_groups_freed(proc: subprocess.CompletedProcess, ranks=(0, 1)) -> None:
    for rank in ranks:
        assert f"[rank{rank}] gloo threads at exit: []" in proc.stdout, proc.stdout[-2000:]
    assert "terminate called" not in proc.stderr
    assert "nanobind: leaked" not in proc.stderr  # triton's objects, when it is loaded: never frozen


@pytest.mark.timeout(120)
def test_normal_exit_waits_for_gathers_then_frees_the_groups(tmp_path, free_port) -> None:
    proc = _launch(tmp_path, free_port, "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank{rank}] in flight after the last step: True" in proc.stdout  # the case that aborts
        assert f"[rank{rank}] destroy_process_group pending=0" in proc.stdout
    _assert_groups_freed(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, code", [("exit3", 3), ("init_only", 0), ("user_destroys", 0)])
def test_every_normal_exit_path_frees_the_groups(tmp_path, free_port, mode, code) -> None:
    proc = _launch(tmp_path, free_port, mode)
    assert proc.returncode == code, proc.stderr[-2000:]
    _assert_groups_freed(proc)


@pytest.mark.timeout(120)
def test_frozen_exit_loses_no_file_and_keeps_the_code(tmp_path, free_port) -> None:
    """Without triton the exit skips finalization's collections (gc.freeze): a file still open in a
    reference cycle, which only they would have closed, is flushed first; the checkpoint saved
    last is complete; the exit code is the script's."""
    proc = _launch(tmp_path, free_port, "files", str(tmp_path))
    assert proc.returncode == 3, proc.stderr[-2000:]
    _assert_groups_freed(proc)
    for rank in (0, 1):
        assert f"[rank{rank}] frozen at exit: True" in proc.stdout, proc.stdout[-2000:]
        assert (tmp_path / f"rank{rank}.log").read_text() == "the last line\n"
    from dslaunch.runtime.checkpoint.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ckpt")
    tag, _ = store.read_latest()
    manifest = store.manifest(tag)
    for name in manifest.files:  # every file verified against its size and checksum
        store.read(tag, name, manifest)


@pytest.mark.timeout(120)
def test_checkpoint_group_is_freed_too(tmp_path, free_port) -> None:
    proc = _launch(tmp_path, free_port, "checkpoint", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    _assert_groups_freed(proc)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, code, shown", [
    ("raise", 1, "raised RuntimeError: user error after training"),
    ("interrupt", 130, "killed by SIGINT (exit code 130) after raising KeyboardInterrupt"),
])
def test_exit_by_exception_keeps_its_code_and_traceback(tmp_path, free_port, mode, code, shown) -> None:
    proc = _launch(tmp_path, free_port, mode)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert shown in proc.stderr.splitlines()[-1]
    _assert_groups_freed(proc, ranks=(1,) if mode == "raise" else (0, 1))


@pytest.mark.timeout(120)
def test_exit_by_exception_does_not_wait_for_a_stuck_peer(tmp_path, free_port) -> None:
    proc = _launch(tmp_path, free_port, "stuck_peer")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "rank 1 on localhost raised RuntimeError: failed with a collective in flight" \
        in proc.stderr
    assert f"did not shut down within {FAILING_EXIT_BOUND_S:.0f} s" in proc.stderr
