"""NVMe offload of parameters (``offload_param.device: nvme``, stage 3): each rank's parameter shard
lives in a nameless swap file between uses.

Training matches single-process torch (losses and final weights) at world 1 and 2 with accumulation
and clipping, with and without the optimizer state on NVMe too, all on disk or partly in host
memory (``max_in_cpu``), tiny staging buffers; between steps ``ShardGroup`` holds no shard (a meta
tensor) and the file holds it; bad paths are one line naming ``offload_param``; nothing is left
after SIGKILL; a checkpoint saved from NVMe resumes without offload.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model
from tests.runtime.zero.equivalence import (
    GLOBAL,
    assert_close,
    config,
    config_16bit,
    engine_losses,
    reference_run,
)
from tests.runtime.zero.test_nvme import _errors, _nvme, _sigkill_leaves_nothing, _swap_fds
from tests.runtime.zero.test_stage3_checkpoint import _load


def _param_nvme(cfg: dict, path: str, max_in_cpu: int = 0, optimizer: bool = False) -> dict:
    zero = cfg["zero_optimization"]
    # buffer_size 40: shards of a few hundred elements pass through many pool buffers (16-bit)
    zero["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_count": 3, "buffer_size": 40,
                             "max_in_cpu": max_in_cpu}
    zero["stage3_param_persistence_threshold"] = 0  # every parameter gathered from the file
    return _nvme(cfg, path) if optimizer else cfg


@pytest.fixture(scope="module")
def reference_weights() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, losses, _ = reference_run()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every weight within 2e-5, except attention's key bias: its true gradient is zero (softmax
    ignores a constant per query), so Adam turns rounding noise into lr-sized steps; every
    engine, stage 0 included, ends ~4e-3 from torch there."""
    for n, t in want.items():
        g = got[n]
        if n.endswith("in_proj_bias"):
            e = t.numel() // 3
            g, t = torch.cat([g[:e], g[2 * e:]]), torch.cat([t[:e], t[2 * e:]])
        torch.testing.assert_close(g, t, rtol=0, atol=2e-5, msg=n)


def _runs(rank: int, world: int, cfgs: list[dict], path: str) -> list[bytes]:
    from tests.runtime.zero.test_stage3_checkpoint import _bytes

    out = []
    for cfg in cfgs:
        weights: dict = {}
        out.append(_bytes((engine_losses(rank, world, cfg, weights=weights), weights)))
    _inspect(rank, cfgs[0], path)
    return out


def _inspect(rank: int, cfg: dict, path: str) -> None:
    """After a step: no shard in memory (meta), the file holds it, gathers read it back."""
    import dslaunch

    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    tokens, labels = batches(1, GLOBAL)[0]
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(tokens[rank:rank + 1], labels[rank:rank + 1]))
        engine.step()
    numel = 0
    for g in engine.zero.groups:
        assert g.shard.device.type == "meta" and g.store.in_cpu == 0
        assert all(p.ds_tensor.device.type == "meta" for p in g.params)
        assert g.master.device.type == "cpu"  # the optimizer's fp32 copy stays in host memory
        torch.testing.assert_close(g.model_shard, g.master.data, rtol=0, atol=0)  # read from the file
        numel += g.shard.numel()
    assert sum(_swap_fds(path)) >= 4 * numel  # fp32 shards on disk
    assert os.listdir(path) == []
    import dslaunch.zero
    from dslaunch.utils import safe_get_full_fp32_param

    w = next(engine.module.parameters())
    with dslaunch.zero.GatheredParameters([w], modifier_rank=0):  # written back into the files
        w.data.fill_(0.25 if rank == 0 else 9.0)
    with dslaunch.zero.GatheredParameters([w]):
        assert torch.all(w.data == 0.25)
    assert torch.all(safe_get_full_fp32_param(w) == 0.25)


@pytest.mark.timeout(180)
def test_nvme_param_matches_single_process(reference_weights, tmp_path: Path) -> None:
    """World 2: all on NVMe; with the optimizer state on NVMe too; partly in memory (max_in_cpu)."""
    losses, weights = reference_weights
    path = str(tmp_path)
    cfgs = [_param_nvme(config(3), path), _param_nvme(config(3), path, optimizer=True),
            _param_nvme(config(3), path, max_in_cpu=50)]
    for per_rank in run_world(_runs, 2, cfgs, path):
        for got_losses, got_weights in map(_load, per_rank):
            assert_close(got_losses, losses, 1e-5)
            _weights_close(got_weights, weights)
    assert os.listdir(path) == []


@pytest.mark.timeout(120)
def test_nvme_param_one_rank_and_bf16(reference_weights, tmp_path: Path) -> None:
    """World 1 (fp32, weights within 2e-5); bf16 on 2 ranks: the shard is 16-bit, the master fp32,
    every transfer passes through the staging pool (3e-2 as every 16-bit run)."""
    losses, weights = reference_weights
    path = str(tmp_path)
    [[data]] = run_world(_runs, 1, [_param_nvme(config(3), path, optimizer=True)], path)
    fp32, got = _load(data)
    assert_close(fp32, losses, 1e-5)
    _weights_close(got, weights)
    for per_rank in run_world(_each_losses, 2, [_param_nvme(config_16bit("bf16", 3), path)]):
        assert_close(per_rank[0], losses, 3e-2)


def _each_losses(rank: int, world: int, cfgs: list[dict]) -> list[list[float]]:
    return [engine_losses(rank, world, cfg) for cfg in cfgs]


@pytest.mark.timeout(90)
def test_nvme_param_bad_path_is_one_line_error(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    errors = run_world(_errors, 1, [_param_nvme(config(3), str(tmp_path / "missing")),
                                    _param_nvme(config(3), str(afile))])[0]
    key = "'zero_optimization.offload_param.nvme_path'"
    assert all(key in e and "\n" not in e for e in errors), errors
    assert "does not exist" in errors[0] and "not a directory" in errors[1]
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.config.ds_config import load_config

    with pytest.raises(ConfigError, match="offload_param.nvme_path'.*is required"):
        load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, 1)
    # below stage 3 DeepSpeed ignores it; so does dslaunch, with a warning (tests/runtime/config)
    assert not load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}, 1).zero_optimization.offload_param.enabled


@pytest.mark.timeout(90)
def test_nvme_param_swap_files_gone_after_sigkill(tmp_path: Path) -> None:
    _sigkill_leaves_nothing(tmp_path, "_param_nvme(config(3), sys.argv[1], optimizer=True)",
                            "from tests.runtime.zero.test_nvme_param import _param_nvme")


def _save(rank: int, world: int, ckpt: str, path: str) -> bytes:
    import dslaunch
    from tests.runtime.zero.test_stage3_checkpoint import GLOBAL as G
    from tests.runtime.zero.test_stage3_checkpoint import _bytes, _cfg, _full_params, _steps

    data = batches(5, G)
    engine, *_ = dslaunch.initialize(model=make_model(), config=_param_nvme(_cfg(3), path))
    _steps(engine, rank, world, data[:3])
    engine.save_checkpoint(ckpt, tag="t")
    full = _full_params(engine)
    assert engine.save_16bit_model(ckpt, "model16.bin")  # gathered from the swap files
    return _bytes((full, _steps(engine, rank, world, data[3:])))


def _resume(rank: int, world: int, ckpt: str) -> bytes:
    import dslaunch
    from tests.runtime.zero.test_stage3_checkpoint import GLOBAL as G
    from tests.runtime.zero.test_stage3_checkpoint import _bytes, _cfg, _full_params, _steps

    engine, *_ = dslaunch.initialize(model=make_model(seed=9), config=_cfg(3, gather=False))
    engine.load_checkpoint(ckpt, tag="t")
    return _bytes((_full_params(engine), _steps(engine, rank, world, batches(5, G)[3:])))


@pytest.mark.timeout(120)
def test_nvme_param_checkpoint_resumes_without_offload(tmp_path: Path) -> None:
    """Saved on 2 ranks with the shards on NVMe, resumed at stage 3 on 1 rank without offload:
    same weights, same next losses; zero_to_fp32 and the 16-bit model file agree."""
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt, swap = tmp_path / "ckpt", tmp_path / "swap"
    swap.mkdir()
    full, later = _load(run_world(_save, 2, str(ckpt), str(swap))[0])
    [(got, losses)] = map(_load, run_world(_resume, 1, str(ckpt)))
    for n, t in full.items():
        torch.testing.assert_close(got[n], t, rtol=0, atol=0, msg=n)
    torch.testing.assert_close(losses, later, rtol=1e-5, atol=0)
    exported = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="t")
    model16 = torch.load(ckpt / "model16.bin", weights_only=True)
    for n, t in full.items():
        assert torch.equal(exported[n], t) and torch.equal(model16[n], t), n
    assert os.listdir(swap) == []


@pytest.mark.timeout(30)
def test_shard_store_ranges_dtypes_and_bounded_pool(tmp_path: Path) -> None:
    """Ranges across the in-memory head and the file, same-dtype reads straight into the target,
    other dtypes through at most ``buffer_count`` staging buffers; the file holds the tail only."""
    from dslaunch.runtime.zero.offload.param_store import ShardStore
    from dslaunch.runtime.zero.offload.swap import SwapSettings

    settings = SwapSettings(str(tmp_path), buffer_count=2, buffer_size=7, block_size=512, queue_depth=2,
                            section="offload_param")
    values = torch.randn(100, dtype=torch.float64).to(torch.bfloat16)
    store = ShardStore(settings, 100, torch.bfloat16, in_cpu=30, pin=False)
    assert store.in_cpu == 30 and _swap_fds(str(tmp_path)) == [70 * 2]
    store.write(0, values.float())  # fp32 -> bf16 through the pool
    assert len(store._pool) == 2 and store.held_bytes() == (30 + 2 * 7) * 2
    for lo, hi in ((0, 100), (25, 35), (40, 97), (3, 9)):
        same = torch.empty(hi - lo, dtype=torch.bfloat16)
        store.read(lo, hi, same)
        wide = torch.empty(hi - lo, dtype=torch.float32)
        store.read(lo, hi, wide)
        assert torch.equal(same, values[lo:hi]) and torch.equal(wide, values[lo:hi].float()), (lo, hi)
    store.write(28, torch.full((5,), 3.0, dtype=torch.bfloat16))  # straight into head and file
    assert torch.equal(store.read_all()[27:34], torch.tensor([values[27].item(), *[3.0] * 5, values[33].item()],
                                                            dtype=torch.bfloat16))
    assert len(store._pool) == 2
    store.close()
    assert _swap_fds(str(tmp_path)) == [] and os.listdir(tmp_path) == []
