"""The engine with ``compression_training`` in its ds_config, on 2 gloo ranks.

fp32 (ZeRO stage 1): a model prepared by ``init_compression`` (weights fake-quantized in forward,
l1 sparse pruning, topk row pruning with its related layer) trains 6 steps; the engine switches each
technique on at its ``schedule_offset`` (flags checked after every step) and the weights equal
plain torch's (the same prepared model, the scheduler stepped by hand, the two ranks' batches in
one, torch's SGD) within 1e-5; ``redundancy_clean`` then shrinks the pruned layers.
fp16 (ZeRO stage 2, MoQ): the weights of the group are quantized after each step: their bits
fall 8 -> 7 -> 6 at the quantizer steps DeepSpeed's rule gives (period 2, doubling), each group
of a weight holds at most 2**bits levels, and both ranks hold the same weights. A loaded engine's
scheduler counts on from the saved applied steps (1 rank).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dslaunch.errors import ConfigError
from tests.distributed import run_world
from tests.runtime.compression.scenarios import TinyBert

STEPS, LR = 6, 0.05
FP32 = {
    "weight_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 1,
                                                  "quantize_weight_in_forward": True},
                            "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 4},
                                                        "modules": ["attention.self"]}}},
    "sparse_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 2, "method": "l1"},
                       "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["head"]}}},
    "row_pruning": {"shared_parameters": {"enabled": True, "schedule_offset": 4, "method": "topk"},
                    "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"],
                                                "related_modules": [["layer.\\w+.output.dense"]]}}},
}
MOQ = {"weight_quantization": {"shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 2},
                               "different_groups": {"wq": {"params": {"start_bits": 8, "target_bits": 6,
                                                                      "quantization_period": 2},
                                                           "modules": ["intermediate.dense"]}}}}


def _config(block: dict, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR}}, "compression_training": block, **extra}


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(100 * step + rank))


def _flags(model: torch.nn.Module) -> list[bool]:
    q = model.layer[0].attention.self.query
    return [q.weight_quantization_enabled, model.head.sparse_pruning_enabled,
            model.layer[0].intermediate.dense.row_pruning_enabled]


def _train_fp32(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.compression.compress import init_compression, redundancy_clean

    torch.manual_seed(0)
    config = _config(FP32, zero_optimization={"stage": 1})
    model = init_compression(TinyBert(), config)
    engine, *_ = dslaunch.initialize(model=model, config=config)
    flags = []
    for step in range(STEPS):
        engine.backward(engine(_batch(rank, step)).pow(2).mean())
        engine.step()
        flags.append(_flags(model))
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    redundancy_clean(model, config)
    return {"flags": flags, "trained": trained, "shapes": {k: tuple(v.shape) for k, v in model.state_dict().items()}}


def _reference_fp32() -> dict:
    from dslaunch.runtime.compression.compress import init_compression
    from dslaunch.runtime.compression.scheduler import CompressionScheduler

    torch.manual_seed(0)
    config = _config(FP32)
    model = init_compression(TinyBert(), config)
    scheduler = CompressionScheduler(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        if step == 0:
            scheduler.step(step_zero_check=True)
        loss = sum(model(_batch(r, step)).pow(2).mean() for r in range(2)) / 2  # the ranks' mean
        loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(180)
def test_engine_trains_with_compression_as_plain_torch() -> None:
    ranks = run_world(_train_fp32, 2, timeout=150)
    # offsets 1, 2, 4: the engine's scheduler counts applied steps as DeepSpeed's
    assert ranks[0]["flags"] == [[True, False, False], [True, True, False], [True, True, False],
                                 [True, True, True], [True, True, True], [True, True, True]]
    reference = _reference_fp32()
    for rank in ranks:
        for key, value in reference.items():
            torch.testing.assert_close(rank["trained"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    shapes = ranks[0]["shapes"]
    assert shapes["layer.0.intermediate.dense.weight"] == (32, 16) and shapes["layer.1.output.dense.weight"] == (16, 32)
    assert "head.sparse_pruning_mask" not in shapes and "layer.0.intermediate.dense.row_mask_scores" not in shapes


def _train_moq(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.compression.compress import init_compression

    torch.manual_seed(0)
    config = _config(MOQ, zero_optimization={"stage": 2}, fp16={"enabled": True, "initial_scale_power": 8})
    model = init_compression(TinyBert(), config)
    engine, *_ = dslaunch.initialize(model=model, config=config)
    w = model.layer[0].intermediate.dense.weight
    out: dict = {"bits": [], "levels": [], "weights": [], "qsteps": []}
    for step in range(7):
        engine.backward(engine(_batch(rank, step)).float().pow(2).mean())
        engine.step()
        out["bits"].append(w.start_bits)
        out["qsteps"].append(engine.quantizer.qsteps)
        out["levels"].append(max(len(torch.unique(g)) for g in w.detach().reshape(2, -1)))
        out["weights"].append(copy.deepcopy(w.detach()))
    out["other"] = len(torch.unique(model.layer[0].output.dense.weight.detach()))
    return out


@pytest.mark.timeout(180)
def test_moq_quantizes_after_each_step_on_its_schedule() -> None:
    ranks = run_world(_train_moq, 2, timeout=150)
    first = ranks[0]
    # the forward of step 0 quantizes once, then every applied step: qsteps 2..8; the bits drop when
    # qsteps reaches the period (2, then 4, then 8), the period doubling each time
    assert first["qsteps"] == [2, 3, 4, 5, 6, 7, 8]
    assert first["bits"] == [7, 7, 6, 6, 6, 6, 6]
    assert all(levels <= 2**bits for levels, bits in zip(first["levels"], first["bits"], strict=True))
    assert first["levels"][-1] > 8  # quantized, not collapsed
    assert first["other"] > 2**8  # layers outside the group are not quantized
    for a, b in zip(first["weights"], ranks[1]["weights"], strict=True):
        assert torch.equal(a, b)


def _moq_without_fp16(rank: int, world: int) -> str:
    import dslaunch

    try:
        dslaunch.initialize(model=TinyBert(), config=_config(MOQ))
    except ConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.timeout(60)
def test_moq_without_fp16_is_one_line_naming_the_key() -> None:
    (msg,) = run_world(_moq_without_fp16, 1)
    assert msg.startswith("'compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward': "
                          "is false") and "fp16.enabled" in msg


def _resume(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.compression.compress import init_compression

    config = _config({k: FP32[k] for k in ("sparse_pruning", "row_pruning")})
    engine, *_ = dslaunch.initialize(model=init_compression(TinyBert(), config), config=config)
    for step in range(4):
        engine.backward(engine(_batch(rank, step)).pow(2).mean())
        engine.step()
    state = engine.engine_state_dict()
    model = init_compression(TinyBert(), config)
    fresh, *_ = dslaunch.initialize(model=model, config=config)
    before = _flags(model)[1:]
    fresh.load_engine_state_dict(state)
    return {"before": before, "after": _flags(model)[1:], "count": fresh.compression_scheduler.training_steps}


@pytest.mark.timeout(90)
def test_a_loaded_engine_counts_on_from_the_saved_steps() -> None:
    (got,) = run_world(_resume, 1)
    # 4 applied steps: sparse pruning (offset 2) and row pruning (offset 4) are due, as they were
    assert got == {"before": [False, False], "after": [True, True], "count": 4}
