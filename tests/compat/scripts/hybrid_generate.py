"""DeepSpeed-Chat's actor in miniature: a tiny GPT-2 under ZeRO-3 with the hybrid engine, one PPO-like
training step, then ``actor.generate(..., synced_gpus=True)``; rank 0 prints the tokens and the same
model's generation in one process (its weights gathered from the engine) for the test to compare.

Usage (2 ranks, ``deepspeed`` command): hybrid_generate.py
"""

import json

import deepspeed
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
config = GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
ds_config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000,
             "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
             "hybrid_engine": {"enabled": True, "max_out_tokens": 64, "inference_tp_size": 1,
                               "release_inference_cache": False, "pin_parameters": True,
                               "tp_gather_partition_size": 8}}
with deepspeed.zero.Init(config_dict_or_path=ds_config):
    model = GPT2LMHeadModel(config)
actor, *_ = deepspeed.initialize(model=model, config=ds_config)
ids = torch.arange(12).view(2, 6) % 50
actor.train()
actor.backward(actor(input_ids=ids, labels=ids).loss)
actor.step()
actor.eval()
tokens = actor.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                        pad_token_id=0, synced_gpus=True)
with deepspeed.zero.GatheredParameters(list(actor.module.parameters())):
    state = {k: v.clone() for k, v in actor.module.state_dict().items()}
if torch.distributed.get_rank() == 0:
    alone = GPT2LMHeadModel(config)
    alone.load_state_dict(state)
    alone.eval()
    want = alone.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                          pad_token_id=0)
    print("TOKENS", json.dumps({"engine": tokens.tolist(), "alone": want.tolist(),
                                "engine_class": type(actor).__name__}), flush=True)
