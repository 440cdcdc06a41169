"""AutoEP (the ds_config ``expert_parallel`` block) on Hugging Face MoE models built from configs,
under ``dslaunch --num_gpus 2`` (gloo, fp32): tiny Mixtral, Qwen3-MoE (``norm_topk_prob`` false and
true) and DeepSeek-V3 converted with their experts spread over both ranks give the unconverted
model's loss and gradients, and three ZeRO-2 steps through ``deepspeed.initialize`` give the losses
of the unconverted model trained in one process (Mixtral's with its router's auxiliary loss, whose
logits Hugging Face records from the router module); a Trainer job with the block trains, and the
model its save_model writes loads with from_pretrained into the unconverted class, giving the
trained model's logits. Folded with AutoTP (tensor 2 x data 2, AutoTP's own planner), tiny Mixtral
and Qwen3-MoE train three clipped steps to the unconverted model's losses and norms."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged

FAMILIES = ["mixtral", "qwen3_moe", "qwen3_moe_norm", "deepseek_v3"]
TOLERANCE = 1e-5


@pytest.mark.timeout(240)
def test_converted_models_equal_the_unconverted_ones(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "autoep_parity.py"), *FAMILIES], cwd=tmp_path, timeout=200)
    results = tagged(out, "PARITY")
    assert sorted(results) == sorted(FAMILIES)
    for family, got in results.items():
        assert got["converted"] == (1 if family == "deepseek_v3" else 2), family  # DeepSeek's layer 0 is dense
        assert got["marked"], f"{family}: expert weights without their expert group (ZeRO would average them)"
        assert got["expert_shapes"][0][0] == 2, f"{family}: each rank should hold 2 of the 4 experts"
        assert got["grads"] == got["ref_grads"], family
        for key in ("loss", "dense_grad", "expert_grad", "train_losses"):
            assert got[key] <= TOLERANCE, f"{family}: {key} differs by {got[key]:.2e}"
        assert got["clipped"], f"{family}: the gradient clip never acted"
        want, aux = got["aux_loss"]
        assert abs(want - aux) <= TOLERANCE and (want > 0) == (family == "mixtral"), f"{family}: aux loss {got['aux_loss']}"
        assert len(set(got["losses"])) == len(got["losses"]), f"{family}: the steps changed nothing"


@pytest.mark.timeout(240)
def test_trainer_with_an_expert_parallel_block_trains(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "trainer_gpt2.py"), "out", "6", "2", "autoep=2", "final=final"], cwd=tmp_path, timeout=200)
    losses = tagged(out, "LOSSES")
    assert tagged(out, "CONVERTED") == 2
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.2, losses
    # save_model wrote the unconverted Mixtral: every expert, the model's names (from_pretrained)
    reloaded = tagged(out, "RELOADED")
    assert not reloaded["problems"] and reloaded["diff"] <= TOLERANCE, reloaded


@pytest.mark.timeout(300)
def test_folded_with_autotp_equals_the_unconverted_models(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", "4", "--master_port", str(free_port()),
                   str(SCRIPTS / "autoep_folded.py"), "mixtral", "qwen3_moe"], cwd=tmp_path, timeout=280)
    results = tagged(out, "FOLDED")
    for family, got in results.items():
        shapes = got["shapes"]
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == [8, 16], f"{family}: attention not split"
        assert shapes["model.layers.0.mlp.gate.router.weight"] == [4, 16], f"{family}: the router was split"
        assert shapes["model.layers.0.mlp.experts.gate_up_proj"][0] == 2, f"{family}: 2 of 4 experts per rank"
        assert got["ref_norm"] > 0.5, f"{family}: the clip never acted"
        assert got["loss"] <= TOLERANCE and got["norm"] <= TOLERANCE, f"{family}: {got}"
