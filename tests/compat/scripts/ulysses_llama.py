"""DeepSpeed's ALST tutorial loop on a tiny random Llama with grouped-query attention (one
key/value head), built from a config: ``UlyssesSPAttentionHF.register_with_transformers``, the
mpu into ``deepspeed.initialize``, ``UlyssesSPDataLoaderAdapter`` over a plain loader, the
model's own loss on ``shift_labels`` weighted over the sequence group. Nothing here names
dslaunch.

Every step is an optimizer step on one micro batch; the group's ranks read different batches
(the adapter trains on each rank's batch in turn), so the job sees the same batches, in the same
order, as a job with SP=1 on the data-parallel ranks alone. Each rank writes
``OUT/rank<N>.json``: its data-parallel index, per-step losses and full averaged gradients.

Usage: ulysses_llama.py OUT SP STAGE LENGTH [STEPS] [lora]
  lora: train LoRA adapters (peft, rank 4 on q_proj and v_proj) of the frozen model instead.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from deepspeed.utils import groups
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, MICRO = 32, 2


def batch(step: int, replica: int, length: int) -> dict:
    """Replica ``replica``'s micro batch at ``step``: tokens counting up from a random start (so
    the loss falls); the first 5 tokens are a prompt."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    ids = (torch.randint(0, VOCAB, (MICRO, 1), generator=g) + torch.arange(length)) % VOCAB
    labels = ids.clone()
    labels[:, :5] = -100
    return {"input_ids": ids, "position_ids": torch.arange(length).expand(MICRO, length), "labels": labels}


def shifted(b: dict) -> dict:
    """``labels`` as ``shift_labels`` (what the adapter emits), for the job without SP."""
    labels = b.pop("labels")
    return {**b, "shift_labels": torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)}


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's, as DeepSpeed's
    out, sp, stage, length = Path(args[0]), int(args[1]), int(args[2]), int(args[3])
    steps = int(args[4]) if len(args) > 4 else 20
    lora = "lora" in args[5:]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights="gaussian"))
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
        micro_batch_size=MICRO, seq_length=length, seq_length_is_variable=True)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "sequence_parallel_size": sp, "steps_per_print": 1000}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=mpu)
    replica = groups._get_data_parallel_rank()
    if sp > 1:
        sp_group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
        mine = [batch(step, replica, length) for step in range(sp_rank, steps, sp)]
        loader = UlyssesSPDataLoaderAdapter(mine, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp,
                                            device=engine.device)
    else:
        loader = [shifted(batch(step, replica, length)) for step in range(steps)]
    losses, grads = [], []
    for micro in loader:
        shift_labels = micro["shift_labels"]
        # the model's loss on pre-shifted labels (Hugging Face's Trainer passes them as labels too)
        loss = engine(**micro, labels=shift_labels).loss
        if sp > 1:  # the tutorial's weighting (every shard's mean by its counted tokens) in its
            # all-reduce form: torch's differentiable all_gather fails backward on gloo when the
            # group is not the world (its fallback scatters from global ranks)
            counted = (shift_labels != -100).sum()
            total = torch.distributed.nn.functional.all_reduce(loss * counted, group=sp_group)
            loss = total / torch.distributed.nn.functional.all_reduce(counted.float(), group=sp_group)
        engine.backward(loss)
        grads.append(torch.cat([deepspeed.utils.safe_get_full_grad(p).reshape(-1)
                                for p in engine.module.parameters() if p.requires_grad]).tolist())
        engine.step()
        losses.append(loss.item())
    record = {"replica": replica, "losses": losses, "grads": grads}
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
