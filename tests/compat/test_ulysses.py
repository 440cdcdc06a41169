"""DeepSpeed's ALST loop (``UlyssesSPAttentionHF``, ``UlyssesSPDataLoaderAdapter``) on a tiny
random Llama with one key/value head, under ``dslaunch`` at ZeRO 3: at SP 2 x DP 2 (world 4), over 20
steps of 63-token sequences (padded and masked to 64), each step's loss and averaged gradients equal
the SP=1 job's on the same batches within 1e-6; so do a LoRA (peft) model's at SP 2 (world 2), and
the Trainer's losses under accelerate's ParallelismConfig.
(DeepSpeed 0.19.8 refuses the length, needs kv_heads >= SP, and gets ZeRO-2's gradients 2x too
large.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged

LENGTH = 63


def _records(compat_bin: Path, work: Path, world: int, sp: int, stage: int, *extra: str) -> list[dict]:
    out = work / f"w{world}-sp{sp}"
    out.mkdir()
    run_job([str(compat_bin / "dslaunch"), "--num_gpus", str(world), "--master_port", str(free_port()),
             str(SCRIPTS / "ulysses_llama.py"), str(out), str(sp), str(stage), str(LENGTH), "20", *extra],
            cwd=work, timeout=420)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# Every ZeRO stage at every layout is the plain-torch model's (tests/runtime/sequence_parallel/
# test_engine.py); through Hugging Face one case per layout (suite time: ~15 s a launch): SP 2 x DP 2
# with the full model, SP 2 alone with a PEFT model (LoRA adapters on a frozen Llama). SP 2 alone
# with the full model at ZeRO 1 ran the same.
_LAYOUTS = [(4, 2, 3, "full"), (2, 2, 3, "lora")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world", "sp", "stage", "model"), _LAYOUTS)
def test_ulysses_llama_trains_as_the_sp1_job(compat_bin: Path, tmp_path: Path, world: int, sp: int,
                                               stage: int, model: str) -> None:
    extra = ("lora",) if model == "lora" else ()
    reference = {r["replica"]: r for r in _records(compat_bin, tmp_path, world // sp, 1, stage, *extra)}
    loss_err = grad_err = 0.0
    for run in _records(compat_bin, tmp_path, world, sp, stage, *extra):
        ref = reference[run["replica"]]
        assert len(run["losses"]) == len(ref["losses"]) == 20
        loss_err = max(loss_err, *(abs(a - b) for a, b in zip(run["losses"], ref["losses"], strict=True)))
        for got, want in zip(run["grads"], ref["grads"], strict=True):
            grad_err = max(grad_err, *(abs(a - b) for a, b in zip(got, want, strict=True)))
    assert max(abs(x) for x in ref["grads"][-1]) > 1e-3  # the compared gradients are not zero
    assert extra or ref["losses"][0] - ref["losses"][-1] > 0.05  # and the full model learns
    assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [3])  # ZeRO-2 ran the same (the stages are test_engine.py's)
def test_trainer_with_accelerates_parallelism_config_trains_as_sp1(compat_bin: Path, tmp_path: Path,
                                                                    stage: int) -> None:
    """``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))``
    unchanged: accelerate registers Ulysses and wraps the loader, the Trainer weighs the shard
    losses; the logged losses equal the one-process job's."""
    losses = {}
    for world, sp in ((1, 1), (2, 2)):
        out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", str(world), "--master_port", str(free_port()),
                       str(SCRIPTS / "trainer_ulysses.py"), f"out{sp}", str(sp), str(stage), "8"], cwd=tmp_path,
                      timeout=420)
        losses[sp] = tagged(out, "LOSSES")
    assert len(losses[2]) == 8 and losses[1][0] - losses[1][-1] > 0.3
    assert losses[2] == pytest.approx(losses[1], abs=1e-6)


_REFUSALS = """
import os, torch
import deepspeed
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from transformers import LlamaConfig, LlamaForCausalLM
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
torch.distributed.init_process_group("gloo")
def model(attn):
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=1, attn_implementation=attn))
for attn, core, sp in (("eager", "eager", 2), ("sdpa", "flash_attention_2", 2), ("sdpa", "sdpa", 2)):
    try:
        UlyssesSPAttentionHF.register_with_transformers(model(attn), core, sp, 1, seq_length=64)
        print("ACCEPTED")
    except Exception as err:
        print(type(err).__name__, str(err).splitlines()[0])
torch.distributed.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_register_with_transformers_refuses_what_would_be_wrong_in_one_line(compat_bin: Path) -> None:
    import os
    import subprocess

    env = {**os.environ, "PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(compat_bin / "python"), "-c", _REFUSALS], env=env, capture_output=True, text=True,
                          timeout=100)
    lines = [line for line in proc.stdout.splitlines() if line]
    assert lines == [
        "UsageError Ulysses sequence parallelism with attn_implementation='eager': it needs the 4D attention mask, "
        "which is quadratic in the sequence and dropped under Ulysses; use 'sdpa' or a flash attention implementation",
        "UsageError register_with_transformers: core_attn_implementation='flash_attention_2' but the model runs "
        "attn_implementation='sdpa'; set both to the same value",
        "UsageError sequence_parallel_size=2 must divide the world size 1",
    ], proc.stdout + proc.stderr[-2000:]


_OFFLOAD = """
import torch
from deepspeed.runtime.activation_checkpointing.offload_activations import (
    get_checkpoint_hidden_states_offloading_ctx_manager)
from transformers import GradientCheckpointingLayer, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=1, attn_implementation="sdpa"))
model.gradient_checkpointing_enable({"use_reentrant": False})
model.train()
ids = torch.randint(0, 32, (2, 40), generator=torch.Generator().manual_seed(1))
def grads(ctx):
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]
plain = grads(torch.enable_grad())
ctx = get_checkpoint_hidden_states_offloading_ctx_manager(min_offload_bytes=0)
offloaded = grads(ctx)
print("EQUAL", all(torch.equal(a, b) for a, b in zip(plain, offloaded)))
s = ctx.stats
print("STATS", s.marked_tensors, s.offloaded_tensors, s.kept_last_tensors, s.restored_tensors, s.offloaded_bytes)
print("UNPATCHED", "__call__" not in vars(GradientCheckpointingLayer) or
      vars(GradientCheckpointingLayer)["__call__"].__name__ != "marked_call")
"""


@pytest.mark.timeout(120)
def test_checkpointed_hidden_states_offload_on_a_hugging_face_llama(compat_bin: Path) -> None:
    """ALST's context manager on transformers' own ``GradientCheckpointingLayer`` (3 layers,
    non-reentrant checkpointing): 2 of the 3 layer inputs go to host memory and come back, the
    gradients are bit for bit those without it, and the layer class is restored afterwards."""
    import os
    import subprocess

    proc = subprocess.run([str(compat_bin / "python"), "-c", _OFFLOAD], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=100)
    lines = [line for line in proc.stdout.splitlines() if line]
    assert lines == ["EQUAL True", f"STATS 3 2 1 2 {2 * 2 * 40 * 32 * 4}", "UNPATCHED True"], proc.stdout + proc.stderr[-2000:]
