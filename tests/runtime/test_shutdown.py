"""A script that never calls destroy_process_group() still leaves cleanly (runtime/shutdown.py)."""

import subprocess
import sys

import pytest

# A DeepSpeed-style script: ZeRO-2 with overlapped parameter gathers still in flight after the last
# step, no destroy_process_group(). The wrapper reports, at the moment the group is destroyed,
# whether any gather was still pending.
SCRIPT = """
import sys
import torch
import torch.distributed as dist
import dslaunch as deepspeed

engine_box = []
original = dist.destroy_process_group
def destroy(*args, **kwargs):
    pending = len(engine_box[0].zero.publisher._works)
    print(f"destroy_process_group pending={pending}", flush=True)
    return original(*args, **kwargs)
dist.destroy_process_group = destroy

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
config = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 4000,
                                "allgather_bucket_size": 2000}}
engine, *_ = deepspeed.initialize(model=model, config=config)
engine_box.append(engine)
for _ in range(3):
    loss = engine(torch.randn(4, 64)).square().mean()
    engine.backward(loss)
    engine.step()
print(f"in flight after the last step: {len(engine.zero.publisher._works) > 0}", flush=True)
if sys.argv[1] == "fail":
    raise RuntimeError("user error after training")
"""


def _launch(tmp_path, port: int, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "--num_gpus", "2",
                           "--master_port", str(port), "--no_local_rank", str(script), mode],
                          capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
def test_normal_exit_waits_for_gathers_then_destroys_the_group(tmp_path, free_port) -> None:
    proc = _launch(tmp_path, free_port, "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        assert f"[rank{rank}] in flight after the last step: True" in proc.stdout  # the case that aborts
        assert f"[rank{rank}] destroy_process_group pending=0" in proc.stdout
    assert "terminate called" not in proc.stderr


@pytest.mark.timeout(120)
def test_exit_by_exception_does_not_wait_on_peers(tmp_path, free_port) -> None:
    proc = _launch(tmp_path, free_port, "fail")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "destroy_process_group" not in proc.stdout
    assert "user error after training" in proc.stderr
