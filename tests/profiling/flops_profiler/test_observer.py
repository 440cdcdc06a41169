"""The ``flops_profiler`` block on real gloo ranks: the engine's observer counts exactly the
profiled optimizer step (all its micro steps, forward and measured backward), at ZeRO-0 and
ZeRO-3 (parameters whole only while used), with activation checkpointing, and summed over a
pipeline's stages; rank 0 prints DeepSpeed's tables with achieved FLOP/s and MFU."""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_world
from tests.profiling.flops_profiler.gpt import analytic_step_flops

pytestmark = pytest.mark.timeout(180)

B, T, GAS = 2, 16, 2

DEEPSPEED_SUMMARY = ["world size", "data parallel size", "model parallel size", "batch size per GPU",
                     "params per GPU", "params of model", "fwd MACs per GPU", "fwd flops per GPU",
                     "fwd flops of model", "fwd latency", "fwd FLOPS per GPU", "bwd latency", "bwd FLOPS per GPU",
                     "fwd+bwd FLOPS per GPU", "step latency", "iter latency", "FLOPS per GPU", "samples/second"]
"""The lines of DeepSpeed 0.19's ``print_model_profile`` summary with an engine, in its order, by
their names up to `` = `` or ``:`` (what a log parser keys on)."""


def _summary(text: str) -> dict[str, str]:
    """The summary's ``name: value`` lines by name, in order (the first block of the text)."""
    block = text.split("Aggregated Profile per GPU")[0]
    out = {}
    for line in block.splitlines():
        if ":  " in line:
            label, value = line.split(":", 1)
            out[label.split(" = ")[0].strip()] = value.strip()
    return out


def _seconds(duration: str) -> float:
    value, unit = duration.split()
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def _train(rank: int, world: int, stage: int, checkpoint: bool, out: str) -> list:
    import torch

    import dslaunch
    from dslaunch.runtime.profiling import mfu
    from tests.profiling.flops_profiler.gpt import GPT

    os.environ[mfu.CACHE_ENV] = out + ".peak.json"
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": GAS, "steps_per_print": 100,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage},
           "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 2, "output_file": out}}
    engine, *_ = dslaunch.initialize(model=GPT(impl="matmul", seq=T, checkpoint=checkpoint), config=cfg)
    for _ in range(3 * GAS):
        tokens = torch.randint(0, 64, (B, T))
        engine.backward(engine(tokens, tokens))
        engine.step()
    p, t = engine.flops_profiler.last, engine.flops_profiler.timing
    return [p.fwd_flops, p.bwd_flops, p.params, t.step, t.micro_steps, t.samples, t.model_flops,
            t.tokens_per_s is not None and t.tokens_per_s > 0, t.iter_s >= t.fwd_s + t.bwd_s]


@pytest.mark.parametrize("stage, checkpoint", [(0, False), (3, False), (3, True)])
def test_the_profiled_step_is_counted_exactly(tmp_path, stage: int, checkpoint: bool) -> None:
    from tests.profiling.flops_profiler.gpt import GPT

    out = str(tmp_path / "flops.txt")
    got = run_world(_train, 2, stage, checkpoint, out)
    model = GPT(impl="matmul", seq=T)
    step = GAS * analytic_step_flops(model, B, T)  # two micro steps, nothing from steps 0 and 2
    fwd = step // 3
    for fwd_flops, bwd_flops, params, at, micro, samples, model_flops, tokens, whole in got:
        assert fwd_flops == fwd
        if checkpoint:  # the blocks' forward recomputed in backward (but their last Linear)
            assert step - fwd < bwd_flops < step
        else:
            assert bwd_flops == step - fwd
        assert params == sum(p.numel() for p in model.parameters())  # whole at ZeRO-3 too
        assert (at, micro, samples, model_flops) == (1, GAS, B * GAS, fwd_flops + bwd_flops)
        assert tokens and whole
    text = open(out).read()
    assert text.count("dslaunch Flops Profiler") == 1  # rank 0 only, once
    assert "Profile Summary at step 1:" in text and "MFU:" in text and "measured" in text
    summary = _summary(text)
    assert [name for name in summary if name in DEEPSPEED_SUMMARY] == DEEPSPEED_SUMMARY  # its names, its order
    assert (summary["world size"], summary["data parallel size"], summary["model parallel size"],
            summary["batch size per GPU"], summary["gradient accumulation steps"]) == ("2", "2", "1", str(B), str(GAS))
    assert float(summary["samples/second"]) == pytest.approx(B * GAS * 2 / _seconds(summary["iter latency"]), rel=0.01)
    assert "(blocks): ModuleList" in text and "(attn): Attention" not in text  # module_depth 2
    assert "bwd flops per GPU (measured)" in text and "tokens/second" in text


def _stage(rank: int, world: int, out: str, fail_rank: int | None = None) -> list:
    import torch

    import dslaunch
    from dslaunch.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    from dslaunch.runtime.profiling import mfu
    from dslaunch.runtime.profiling.counter import FlopCounter

    def broken(*_: object) -> None:
        raise RuntimeError("made to fail")

    if rank == fail_rank:
        FlopCounter._replay = broken  # type: ignore[method-assign]
    os.environ[mfu.CACHE_ENV] = out + ".peak.json"
    dslaunch.init_distributed(verbose=False)
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=1))
    width = 8 * (grid.get_stage_id() + 1)  # unequal stages: mp_size x one stage would be wrong
    piece = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "flops_profiler": {"enabled": True, "profile_step": 0, "output_file": out}}
    engine, *_ = dslaunch.initialize(model=piece, mpu=grid, config=cfg)
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        engine.step()
    p, t = engine.flops_profiler.last, engine.flops_profiler.timing
    if p is None:
        return [None, None, None, None, engine.global_steps]
    return [p.fwd_flops + p.bwd_flops, p.params, t.model_flops, t.model_params, engine.global_steps]


def test_a_pipelines_model_flops_are_summed_over_its_stages(tmp_path) -> None:
    out = str(tmp_path / "flops.txt")
    got = run_world(_stage, 2, out)
    # stage s: Linear(8, w) + Linear(w, 1), w = 8(s + 1); batch 4; the first input needs no gradient
    per_stage = [4 * (2 * 8 * w + 2 * w) + 4 * (2 * 8 * w + 4 * w) for w in (8, 16)]
    params = [8 * w + w + w + 1 for w in (8, 16)]
    for rank, (flops, n, model_flops, model_params, _) in enumerate(got):
        assert (flops, n) == (per_stage[rank], params[rank])
        assert (model_flops, model_params) == (sum(per_stage), sum(params))
    assert "model parallel size:" in open(out).read()


def test_a_stage_whose_counting_fails_does_not_hang_the_others(tmp_path) -> None:
    out = str(tmp_path / "flops.txt")
    got = run_world(_stage, 2, out, 1, timeout=120)
    assert got[1] == [None, None, None, None, 2]  # trained on, nothing counted
    flops, _, model_flops, _, steps = got[0]
    assert steps == 2 and model_flops == flops  # stage 1 added nothing to the sum ...
    assert "(incomplete: a model-parallel rank could not count)" in open(out).read()  # ... and rank 0 says so


def _not_reached(rank: int, world: int, out: str) -> list:
    import torch

    import dslaunch

    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    off, *_ = dslaunch.initialize(model=torch.nn.Linear(4, 1), config=base)
    cfg = {**base, "flops_profiler": {"enabled": True, "profile_step": 5, "output_file": out}}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(4, 1), config=cfg)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).sum())
        engine.step()
    return [off.flops_profiler is None, engine.flops_profiler.last is None, engine.flops_profiler.counter is None]


def test_nothing_is_counted_before_profile_step_or_when_off(tmp_path) -> None:
    out = tmp_path / "flops.txt"
    assert run_world(_not_reached, 1, str(out)) == [[True, True, True]]
    assert not out.exists()


def _under_torch_profiler(rank: int, world: int, out: str) -> list:
    import logging

    import torch

    import dslaunch

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dslaunch.profiling").addHandler(handler)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": out}}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(4, 1), config=cfg)
    for step in range(3):
        if step == 1:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                engine.backward(engine(torch.randn(2, 4)).sum())
                engine.step()
        else:
            engine.backward(engine(torch.randn(2, 4)).sum())
            engine.step()
    return [engine.global_steps, engine.flops_profiler.last is None, seen]


def test_a_step_under_torchs_profiler_is_skipped_with_one_line(tmp_path) -> None:
    out = tmp_path / "flops.txt"
    [[steps, nothing, seen]] = run_world(_under_torch_profiler, 1, str(out))
    assert steps == 3 and nothing and not out.exists()  # trained on, nothing profiled
    assert len(seen) == 1 and "torch.profiler is running at step 1" in seen[0] and "\n" not in seen[0]


def _cifar(rank: int, world: int, out: str, fail: str | None) -> list:
    import logging

    import torch
    import torch.nn.functional as F

    import dslaunch
    from dslaunch.runtime.profiling import mfu
    from dslaunch.runtime.profiling.counter import FlopCounter
    from dslaunch.runtime.profiling.formulas import FORMULAS
    from tests.profiling.flops_profiler.cifar import cifar_net

    def broken(*_: object) -> None:
        raise RuntimeError("made to fail")

    os.environ[mfu.CACHE_ENV] = out + ".peak.json"
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dslaunch.profiling").addHandler(handler)
    if fail == "formula":
        FORMULAS["aten::convolution_backward"] = broken
    elif fail == "counting":
        FlopCounter._replay = broken  # type: ignore[method-assign]
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
           "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": out}}
    engine, *_ = dslaunch.initialize(model=cifar_net(), config=cfg)
    losses = []
    for _ in range(4):
        loss = F.cross_entropy(engine(torch.randn(4, 3, 32, 32)), torch.randint(0, 10, (4,)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    last = engine.flops_profiler.last
    return [engine.global_steps, losses, last and (last.fwd_flops, last.bwd_flops), seen]


def test_deepspeeds_cifar_model_is_profiled_and_a_failing_count_never_stops_training(tmp_path) -> None:
    from tests.profiling.flops_profiler.cifar import cifar_flops

    fwd, bwd, convs_bwd = cifar_flops(4)
    runs = {fail: run_world(_cifar, 1, str(tmp_path / f"{fail}.txt"), fail)[0] for fail in (None, "formula", "counting")}
    steps, losses, counts, seen = runs[None]
    assert steps == 4 and counts == (fwd, bwd) and seen == []
    assert "Profile Summary at step 2:" in (tmp_path / "None.txt").read_text()
    for fail in ("formula", "counting"):
        assert runs[fail][:2] == [4, losses]  # trained on, the same steps
    _, _, counts, seen = runs["formula"]
    assert counts == (fwd, bwd - convs_bwd)  # the operator skipped, the rest counted
    assert len(seen) == 1 and "aten::convolution_backward not counted (RuntimeError: made to fail)" in seen[0]
    _, _, counts, seen = runs["counting"]
    assert counts is None and not (tmp_path / "counting.txt").exists()
    assert len(seen) == 1 and "profiling step 2 failed (RuntimeError: made to fail)" in seen[0]
    assert "training goes on" in seen[0] and "\n" not in seen[0]
