"""``engine.offload_states`` / ``reload_states`` on a CUDA device: ``torch.cuda.memory_allocated``
drops by at least the bytes of the states moved and comes back on reload; each state's tensors are
on the host meanwhile (pinned where asked); training after the round trip is bitwise the same as
without it. One rank, bf16, ZeRO 1, 2 and 3, blocking and non-blocking copies.

Marked ``gpu``: skipped without a CUDA device; ``scripts/gpu/check.sh`` runs it
(``pytest -m gpu tests/gpu``). The bookkeeping on CPU, at 2 ranks: ``tests/runtime/zero/test_offload_states.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.gpu.marks import NEEDS_CUDA

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    NEEDS_CUDA,
]

DIM, LAYERS, STEPS = 1024, 4, 3


def _nbytes(engine, states) -> int:
    """Bytes on the device of ``states``' distinct storages."""
    seen = {}
    for s in states:
        for h in engine.zero.state_holders(s):
            t = h.get()
            if torch.is_tensor(t) and t.is_cuda:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    seen.pop(0, None)
    return sum(seen.values())


def _run(rank: int, world: int, stage: int, non_blocking: bool) -> dict:
    import dslaunch
    from dslaunch.runtime.zero.offload_config import OffloadStateTypeEnum as S
    from dslaunch.runtime.zero.offload_states import get_state_devices

    if not torch.distributed.is_initialized():
        dslaunch.init_distributed(verbose=False)
    x = torch.randn(4, DIM, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(1))
    out: dict = {}
    for trip in (False, True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)])
        cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6, "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, *_ = dslaunch.initialize(model=model, config=cfg)
        losses = []
        for i in range(STEPS):
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if trip and i == 0:
                torch.cuda.synchronize()
                states = list(S)
                expected = _nbytes(engine, states)
                before = torch.cuda.memory_allocated()
                engine.offload_states(include=states, pin_memory=True, non_blocking=non_blocking)
                torch.cuda.synchronize()
                during = torch.cuda.memory_allocated()
                devices = {s.value: sorted(map(str, get_state_devices(engine, s))) for s in states}
                pinned = all(m.host.is_pinned() for moves in engine.zero._states.moved.values() for m in moves)
                engine.reload_states(non_blocking=non_blocking)
                torch.cuda.synchronize()
                out.update(before=before, during=during, after=torch.cuda.memory_allocated(), expected=expected,
                           devices=devices, pinned=pinned)
            if trip and i == 1:  # generation with the optimizer's states away
                engine.offload_states(include=[S.optim_states, S.hp_params, S.contiguous_grad_buffer])
                with torch.no_grad():
                    engine(x)
                engine.reload_states()
        weights = [p.detach().float().cpu() for p in engine.module.parameters()] if stage < 3 else \
            [dslaunch.utils.safe_get_full_fp32_param(p).cpu() for p in engine.module.parameters()]
        out[trip] = (losses, weights)
        engine.destroy()
        del engine, model
        torch.cuda.empty_cache()
    out["bitwise"] = out[False][0] == out[True][0] and all(
        torch.equal(a, b) for a, b in zip(out[False][1], out[True][1], strict=True))
    del out[False], out[True]
    return out


def _every_case(rank: int, world: int) -> dict:
    """Every (stage, non_blocking) in one process: one NCCL start for all of them."""
    return {(stage, nb): _run(rank, world, stage, nb) for stage in (1, 2, 3) for nb in (False, True)}


def test_memory_drops_and_training_is_bitwise() -> None:
    for (stage, non_blocking), r in run_world(_every_case, 1)[0].items():
        print(f"stage {stage} non_blocking={non_blocking}: {r}")
        assert r["expected"] > 0 and r["before"] - r["during"] >= r["expected"], (stage, non_blocking, r)
        assert r["after"] - r["during"] >= r["expected"], (stage, non_blocking, r)
        assert r["pinned"], (stage, non_blocking, r)
        assert all(d in ([], ["cpu"]) for d in r["devices"].values()), (stage, non_blocking, r)
        assert r["bitwise"], (stage, non_blocking, r)
