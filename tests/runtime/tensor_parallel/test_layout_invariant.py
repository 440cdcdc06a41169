"""Layout-invariant AutoTP training (``layout_invariant``): the same bits at tp 2 x dp 2 and at tp 4.

On 4 gloo ranks, fp32, Adam with clipping: tp 2 x dp 2 (each data rank one half of the global
batch) and tp 4 with 2 accumulation steps (the two halves in turn) see the same global batch per
step. Under the mode every loss, weight and Adam moment is the same bits in both layouts, so a tag
saved in one resumes in the other exactly as a run that never stopped there.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.tensor_parallel.models import TrainableLM, rule_batch

HALF = 4  # samples: half the global batch of rule_batch's 8
BEFORE, AFTER = 2, 2  # steps before the save, and after it


def _engine(tp: int, stage: int, chunks: int = 4):
    import dslaunch

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": HALF, "gradient_accumulation_steps": tp // 2,
              "optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp},
              "layout_invariant": {"enabled": True, "chunks": chunks}, "steps_per_print": 1000}
    return dslaunch.initialize(model=TrainableLM(), config=config)[0]


def _steps(engine, first: int, count: int) -> list[float]:
    """``count`` global steps; each step's loss: the mean of the two halves' losses, added in one
    order whichever rank or micro-step computed each."""
    out = []
    for step in range(first, first + count):
        halves = torch.zeros(2)
        for micro in range(engine.gradient_accumulation_steps()):
            half = engine.grid.get_data_parallel_rank() + micro  # dp 2 x gas 1 or dp 1 x gas 2
            ids = rule_batch(step)[half * HALF:(half + 1) * HALF]
            loss = engine(input_ids=ids, labels=ids)
            engine.backward(loss)
            engine.step()
            halves[half] = loss.detach()
        torch.distributed.all_reduce(halves, op=torch.distributed.ReduceOp.MAX)  # each half's loss, as it is
        out.append(((halves[0] + halves[1]) / 2).item())
    return out


def _state(engine) -> list[torch.Tensor]:
    """This rank's weights (its tensor slices) and Adam moments (its ZeRO partition of them)."""
    optimizer = engine.optimizer
    moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return [p.detach().clone() for p in engine.module.parameters()] + [t.clone() for t in moments]


def _resume(rank: int, world: int, root: str, stage: int) -> dict:
    """Both layouts run BEFORE + AFTER steps without stopping, each saving at BEFORE; each tag
    resumes in the other layout for AFTER steps."""
    runs, states = {}, {}
    for tp in (2, 4):
        engine = _engine(tp, stage)
        runs[tp] = _steps(engine, 0, BEFORE)
        engine.save_checkpoint(root, tag=f"tp{tp}")
        runs[tp] += _steps(engine, BEFORE, AFTER)
        states[tp] = _state(engine)
    resumed = {}
    for tp, saved in ((4, 2), (2, 4)):
        engine = _engine(tp, stage)
        engine.load_checkpoint(root, tag=f"tp{saved}")
        resumed[tp] = _steps(engine, BEFORE, AFTER)
        mine, straight = _state(engine), states[tp]
        resumed[f"equal{tp}"] = len(mine) == len(straight) and all(
            torch.equal(a, b) for a, b in zip(mine, straight, strict=True))
        resumed[f"worst{tp}"] = max((a - b).abs().max().item() for a, b in zip(mine, straight, strict=True))
    return {"runs": runs, "resumed": resumed}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_tag_saved_at_one_degree_resumes_bit_for_bit_at_another(tmp_path, stage: int) -> None:
    for got in run_world(_resume, 4, str(tmp_path), stage, timeout=200):
        runs, resumed = got["runs"], got["resumed"]
        assert runs[2] == runs[4], runs  # the two layouts never differ, bit for bit
        assert runs[2][-1] < runs[2][0], runs  # it trains
        assert resumed[4] == runs[4][BEFORE:], (resumed[4], runs[4])  # 2 -> 4
        assert resumed[2] == runs[2][BEFORE:], (resumed[2], runs[2])  # 4 -> 2
        assert resumed["equal4"] and resumed["equal2"], resumed  # every weight and Adam moment


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hugging_face_llama_and_gpt2(compat_bin, tmp_path) -> None:
    """Llama's eager attention rounds apart at 2 vs 4 query heads a rank unless run one KV head at
    a time (measured: 4.8e-7 apart by the 2nd step with the block off)."""
    from pathlib import Path

    from dslaunch.utils.ports import free_port
    from tests.compat.conftest import run_job, tagged

    script = str(Path(__file__).resolve().parent / "scripts" / "hf_invariant.py")
    got = tagged(run_job([str(compat_bin / "dslaunch"), "--num_gpus", "4", "--master_port", str(free_port()),
                          script], cwd=tmp_path, timeout=300), "RESULTS")
    for family in ("llama", "gpt2"):
        on = got[f"{family}@on"]
        assert on["2"] == on["4"], (family, on)
        assert on["2"] == pytest.approx(got[f"{family}@off"]["2"], abs=1e-6)  # the same model, rounded alike or nearly
