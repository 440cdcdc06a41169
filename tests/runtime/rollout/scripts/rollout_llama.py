"""``HybridEngineRollout`` on a tiny Hugging Face Llama (built from a config, nothing downloaded) under
the hybrid engine at ZeRO stage STAGE, then a short on-policy distillation loop.

Each rank has its own left-padded prompts. It reports, as ``ROLLOUT {json}``:
- ``greedy``: the rollout's greedy batch (input_ids, attention_mask, response_start_idx) and the
  targets and mask of ``ResponseTokenBatch.from_rollout``;
- ``reference``: the same weights' own ``generate`` in this process alone (no engine), stopping at
  the EOS the tokenizer names, and the prompts' mask;
- ``top_k1`` / ``top_p0``: sampled rollouts (2 samples per prompt) with ``top_k=1`` and with a
  vanishing ``top_p``, both of which must equal greedy decoding;
- ``sampled``: a sampled batch's shape and token range; ``profile``: a profiled greedy rollout's timings;
- ``losses``: the JSD to a teacher on one fixed rollout before and after each of STEPS optimizer
  steps of the loop (rollout, loss on its responses, ``engine.backward``, ``engine.step``), and
  ``moved``: the largest change of a weight over the loop.

Written as a DeepSpeed script (``import deepspeed``, through the compat distribution).

Usage: dslaunch --num_gpus 2 rollout_llama.py STAGE
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.rollout import (
    HybridEngineRollout,
    ResponseTokenBatch,
    RolloutConfig,
    RolloutRequest,
    SamplingConfig,
    build_rollout,
    generalized_jsd_loss,
)
from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig
from transformers import LlamaConfig, LlamaForCausalLM

STAGE, STEPS, NEW, VOCAB, PAD = int(sys.argv[-1]), 3, 6, 40, 0
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     pad_token_id=PAD, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
             "zero_optimization": {"stage": STAGE, "stage3_param_persistence_threshold": 0},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
             "hybrid_engine": {"enabled": True, "pin_parameters": True}}


def prompts(rank: int) -> RolloutRequest:
    """Two left-padded prompts (the second two tokens shorter), different on each rank."""
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(2, VOCAB, (2, 5), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0
    return RolloutRequest(prompt_ids=ids, prompt_attention_mask=mask)


def whole_state(engine) -> dict[str, torch.Tensor]:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def reference(state: dict[str, torch.Tensor], request: RolloutRequest, eos: int) -> list[list[int]]:
    """The weights' own greedy generate, one process, stopping at ``eos``."""
    alone = LlamaForCausalLM(CONFIG)
    alone.load_state_dict(state)
    alone.eval()
    return alone.generate(request.prompt_ids, attention_mask=request.prompt_attention_mask, max_new_tokens=NEW,
                          do_sample=False, eos_token_id=eos, pad_token_id=PAD).tolist()


def batch_json(batch) -> dict:
    targets = ResponseTokenBatch.from_rollout(batch)
    return {"input_ids": batch.input_ids.tolist(), "attention_mask": batch.attention_mask.tolist(),
            "mask_dtype": str(batch.attention_mask.dtype), "response_start_idx": batch.response_start_idx.tolist(),
            "target_ids": targets.target_ids.tolist(), "response_mask": targets.response_mask.tolist()}


def jsd(engine, teacher, batch) -> torch.Tensor:
    targets = ResponseTokenBatch.from_rollout(batch)
    student = targets.select_causal_logits(engine(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits)
    with torch.no_grad():
        teacher_logits = targets.select_causal_logits(teacher(input_ids=batch.input_ids,
                                                              attention_mask=batch.attention_mask).logits)
    return generalized_jsd_loss(student, teacher_logits, targets.response_mask, beta=0.5).loss


def main() -> None:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=DS_CONFIG, enabled=STAGE == 3):
        model = LlamaForCausalLM(CONFIG)
    engine, *_ = deepspeed.initialize(model=model, config=DS_CONFIG)
    rank = dist.get_rank()
    request = prompts(rank)
    state = whole_state(engine)
    # The EOS is a token this rank's greedy rollout makes mid-response (row 0's third), so that
    # stopping and padding after it are exercised.
    probe = build_rollout(RolloutConfig(), engine, SimpleNamespace(pad_token_id=PAD, eos_token_id=None))
    eos = int(probe.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=0.0)).input_ids[0, 5 + 2])
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=eos)
    rollout = build_rollout(RolloutConfig(), student_engine=engine, tokenizer=tokenizer)
    engine.eval()
    out = {"rank": rank, "engine": type(engine).__name__, "eos": eos,
           "greedy": batch_json(rollout.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=0.0))),
           "reference": reference(state, request, eos), "prompt_mask": request.prompt_attention_mask.tolist()}
    for name, knobs in (("top_k1", {"top_k": 1}), ("top_p0", {"top_p": 1e-9})):
        sampled = rollout.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=0.8,
                                                           n_samples_per_prompt=2, **knobs))
        out[name] = sampled.input_ids.tolist()
    profiled = HybridEngineRollout(engine, tokenizer, HybridEngineRolloutConfig(enable_profiling=True))
    profiled.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=0.0))
    out["profile"] = profiled.get_last_profile()
    sampled = rollout.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=1.5, top_p=0.9,
                                                       n_samples_per_prompt=3)).input_ids
    out["sampled"] = {"shape": list(sampled.shape), "low": int(sampled.min()), "high": int(sampled.max())}

    torch.manual_seed(1)
    teacher = LlamaForCausalLM(CONFIG).eval()
    fixed = rollout.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=1.0))
    losses = []
    for _ in range(STEPS):
        engine.eval()
        batch = rollout.generate(request, SamplingConfig(max_new_tokens=NEW, temperature=1.0))
        engine.train()
        with torch.no_grad():
            losses.append(jsd(engine, teacher, fixed).item())
        loss = jsd(engine, teacher, batch)
        engine.backward(loss)
        engine.step()
    with torch.no_grad():
        losses.append(jsd(engine, teacher, fixed).item())
    after = whole_state(engine)
    out["losses"] = losses
    out["moved"] = max((after[k] - state[k]).abs().max().item() for k in state)
    print("ROLLOUT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
