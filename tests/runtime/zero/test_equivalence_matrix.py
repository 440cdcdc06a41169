"""Issue 12's matrix: stage 3 alone and with each offload, fp32/bf16/fp16, at world sizes 1, 2, 4,
reproduces single-process torch training, compared on the final whole weights.

The setup is ``equivalence.py``'s (AdamW with weight decay, 2 accumulation micro steps, tiny
buckets, clipping at 0.5 that is active on every step: the reference's norms are checked to exceed
it) with ``stage3_param_persistence_threshold: 0`` so every parameter is partitioned and offloaded.
One ``run_world`` per world size trains every configuration in the same processes. After training,
the weights the forward uses (the consolidated 16-bit state dict) are exactly the fp32 masters cast
to the model dtype, so the offloaded update's write-back is checked too.

Tolerances:
- fp32: the final fp32 master weights (``safe_get_full_fp32_param``) within 2e-5 max abs of the
  torch model (issue 12's bound; DeepSpeed 0.19.8 got 3.6e-7 on a small MLP; dslaunch 1.2e-7 here),
  all but the attention's key bias (``KEY_BIAS``: why), losses and pre-clip gradient norms within
  1e-5 relative per step (``test_stage3.py``'s bound).
- bf16/fp16: the forward runs in 16 bits, so they cannot reproduce fp32 torch bit for bit; as in
  ``test_stage3.py``/``test_nvme.py`` their losses track the fp32 reference within 3e-2 relative per
  step (fp16 with dynamic loss scaling from 2**8, no step skipped). Offloading must not change the
  16-bit numerics either: each offload's final fp32 master weights equal stage 3 alone's at the same
  precision and world size within the same 2e-5 max abs. (Not bit for bit: the offloaded update is
  another Adam kernel, 1 fp32 ulp away; in fp16 that ulp can flip a weight's 16-bit rounding, which
  moves later updates by ~lr * 1e-3: 4e-6 measured at world 2.) Against torch the 16-bit weights
  are ~10% of their total displacement away (16-bit forward), too loose to be a useful bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches
from tests.runtime.zero.equivalence import (
    CLIP,
    GLOBAL,
    assert_close,
    config,
    config_16bit,
    reference_run,
    train_steps,
)

MATRIX_STEPS = 6
ATOL, LOSS_RTOL_16BIT = 2e-5, 3e-2
PRECISIONS = ("fp32", "bf16", "fp16")


def offloads(nvme_path: str) -> list[tuple[str, dict]]:
    """(name, zero_optimization keys) of every configuration the matrix trains (``max_in_cpu: 0``:
    every parameter shard really lives in the swap file)."""
    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 6, "buffer_size": 96}
    return [
        ("stage3", {}),
        ("offload_optimizer cpu", {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
        ("offload_param cpu", {"offload_param": {"device": "cpu", "pin_memory": True}}),
        ("offload_optimizer+param cpu", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
        ("offload_optimizer nvme", {"offload_optimizer": nvme, "sub_group_size": 1000}),
        ("offload_param nvme", {"offload_param": {**nvme, "max_in_cpu": 0}}),
    ]


def _config(precision: str, zero: dict) -> dict:
    cfg = config(3) if precision == "fp32" else config_16bit(precision, 3)
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, **zero)
    return cfg


Result = tuple[list[float], list[float], dict[str, list]]  # losses, pre-clip norms, final weights


def _train(rank: int, world: int, cfg: dict) -> Result:
    import dslaunch
    from dslaunch.utils import safe_get_full_fp32_param
    from tests.runtime.models import make_model

    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    losses, norms = [], []
    for batch in batches(MATRIX_STEPS, GLOBAL):
        losses += train_steps(engine, rank, world, [batch])
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == MATRIX_STEPS and engine.skipped_steps == 0
    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    published = engine._zero3_consolidated_16bit_state_dict()  # on rank 0: the weights forward uses
    for n, master in masters.items() if rank == 0 else ():
        assert torch.equal(published[n], master.to(published[n].dtype)), f"{n}: published != master"
    # Lists, not tensors: tensors do not survive the result queue once the rank exits.
    return losses, norms, {n: m.flatten().tolist() for n, m in masters.items()}


def _matrix(rank: int, world: int, cfgs: list[dict]) -> list[Result]:
    return [_train(rank, world, cfg) for cfg in cfgs]


# The attention's key bias: its exact gradient is zero (a shift of every key by one vector adds the
# same q.b to all scores of a query, which softmax ignores), so its gradient is rounding noise of
# ~1e-9 that Adam's normalisation turns into steps of ~lr, in a direction set by the summation
# order: plain torch accumulating 2 half batches ends 1.7e-3 away there (every other weight within
# 1.2e-7). ``torch_run`` checks that gradient is zero; all other weights are compared.
KEY_BIAS = ("block.self_attn.in_proj_bias", slice(16, 32))


def _compared(weights: dict[str, list]) -> dict[str, list]:
    name, keys = KEY_BIAS
    return {**weights, name: weights[name][:keys.start] + weights[name][keys.stop:]}


def _max_diff(got: dict[str, list], want: dict[str, list]) -> tuple[float, str]:
    got, want = _compared(got), _compared(want)
    assert got.keys() == want.keys()
    return max((max(abs(a - b) for a, b in zip(got[n], want[n], strict=True)), n) for n in want)


@pytest.fixture(scope="module")
def torch_run() -> Result:
    model, losses, norms = reference_run(MATRIX_STEPS)
    assert min(norms) > CLIP, norms  # clipping changes every step
    assert losses[-1] < losses[0]
    tokens, labels = batches(1, GLOBAL)[0]
    model(tokens, labels).backward()
    name, keys = KEY_BIAS
    assert model.get_parameter(name).grad[keys].abs().max() < 1e-6
    return losses, norms, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


@pytest.mark.slow  # ~65 s for the three at load 5 (world 4: ~37 s)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_stage3_offload_matrix_matches_single_process(world: int, torch_run: Result, tmp_path: Path) -> None:
    ref_losses, ref_norms, ref_weights = torch_run
    names = offloads(str(tmp_path))
    cases = [(p, name, _config(p, zero)) for p in PRECISIONS for name, zero in names]
    per_rank = run_world(_matrix, world, [cfg for *_, cfg in cases], timeout=240)
    for rank, results in enumerate(per_rank):
        by_case = {(p, name): r for (p, name, _), r in zip(cases, results, strict=True)}
        for (precision, name), (losses, norms, weights) in by_case.items():
            where = f"world {world} rank {rank} {precision} {name}"
            if precision == "fp32":
                diff, param = _max_diff(weights, ref_weights)
                assert diff <= ATOL, f"{where}: {param} differs by {diff:.3g} from torch"
                assert_close(losses, ref_losses, 1e-5, f"{where} loss ")
                assert_close(norms, ref_norms, 1e-5, f"{where} grad norm ")
            else:
                diff, param = _max_diff(weights, by_case[(precision, "stage3")][2])
                assert diff <= ATOL, f"{where}: {param} differs by {diff:.3g} from stage 3 alone"
                assert_close(losses, ref_losses, LOSS_RTOL_16BIT, f"{where} loss ")
                assert_close(norms, ref_norms, LOSS_RTOL_16BIT, f"{where} grad norm ")
    assert list(tmp_path.iterdir()) == []  # the NVMe swap files left nothing behind
