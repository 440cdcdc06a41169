"""AutoTP training of tiny Hugging Face models built from configs (no download): Llama with GQA
and GPT-2 (tied lm_head, Conv1D layers, fused qkv). Each family trains 10 AdamW steps at every
tp in argv (data parallel: what the world leaves; tp 4 with ``loss_parallel``) on one fixed global batch per step; rank 0
prints ``RESULTS {json}`` with the losses (averaged over the data ranks) and its parameter bytes.

Each run's tag is saved under DIR and exported by zero_to_fp32 into the whole model: its loss on
the next batch is reported beside the engine's.

Usage: dslaunch --num_gpus N hf_train.py DIR TP [TP...]   (also alone: python hf_train.py DIR 1)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import transformers as T

import dslaunch

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 10, 4, 10, 96
CONFIGS = {
    "llama": lambda: T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                                   max_position_embeddings=32, tie_word_embeddings=False),
    "gpt2": lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                 bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    config = CONFIGS[family]()
    config._attn_implementation = "eager"
    return T.AutoModelForCausalLM.from_config(config)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    ids = [torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=g)]
    for _ in range(SEQ - 1):
        ids.append((7 * ids[-1] + 2) % VOCAB)
    return torch.stack(ids, dim=1)


def train(family: str, tp: int, root: str) -> dict:
    model = build(family)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = world // tp
    config = {"train_batch_size": GLOBAL_BATCH // dp * world, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
              # tp 4: the logits stay split into the model's own loss_function (the vocab-parallel one)
              "tensor_parallel": {"autotp_size": tp, "loss_parallel": tp == 4}}
    engine, *_ = dslaunch.initialize(model=model, config=config)
    rank, micro = engine.grid.get_data_parallel_rank(), GLOBAL_BATCH // dp
    losses = []
    for step in range(STEPS):
        ids = batch(step)[rank * micro:(rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    engine.save_checkpoint(root, tag=f"{family}-tp{tp}")
    with torch.no_grad():  # loss_parallel: this rank's vocabulary slice of the logits
        width = engine(input_ids=ids).logits.shape[-1]
    return {"losses": losses, "bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
            "whole": whole, "next": next_loss(engine, rank * micro, (rank + 1) * micro, world), "width": width}


def next_loss(model: torch.nn.Module, start: int, stop: int, world: int) -> float:
    """The loss on the batch after the last step (the data ranks' mean), no update."""
    ids = batch(STEPS)[start:stop]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= world
    return loss.item()


def exported(family: str, root: str, tag: str) -> float:
    """zero_to_fp32 of the tag into the whole model: its loss on the next batch."""
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    model = build(family)
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(root, tag=tag), strict=False)
    model.tie_weights()  # GPT-2's lm_head is the embedding: saved once
    ids = batch(STEPS)
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def main() -> None:
    tps = [int(a) for a in sys.argv[1:] if a.isdigit()]  # the launcher appends --local_rank
    root = next(a for a in sys.argv[1:] if not a.isdigit() and not a.startswith("--"))
    results = {f"{family}@tp{tp}": train(family, tp, root) for tp in tps for family in CONFIGS}
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        for key, got in results.items():
            family, tp = key.split("@")
            got["exported"] = exported(family, root, f"{family}-{tp}")
        print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
