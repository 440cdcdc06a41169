"""A script shaped like DeepSpeed's Hugging Face text-generation example (DeepSpeedExamples
inference/huggingface/text-generation), in our words, for machines without that checkout:
``see_memory_usage(..., True)`` from ``deepspeed.runtime.utils`` around the steps, a GPT-2 built
under ``deepspeed.OnDevice`` (on the CPU, in float32: its weights must be real to generate),
``init_inference(mp_size=WORLD_SIZE, dtype=..., replace_with_kernel_inject=False, max_tokens=...)``,
``get_accelerator().synchronize()`` around greedy generation. Rank 0 prints ``SAME true|false``:
whether the split model generated the tokens the unsplit model generates.
"""

import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import see_memory_usage
from transformers import GPT2Config, GPT2LMHeadModel

world_size = int(os.getenv("WORLD_SIZE", "1"))
local_rank = int(os.getenv("LOCAL_RANK", "0"))
see_memory_usage("before init", local_rank == 0)
config = GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=4)
torch.manual_seed(0)
with deepspeed.OnDevice(dtype=torch.float32, device="cpu"):
    model = GPT2LMHeadModel(config).eval()
reference = GPT2LMHeadModel(config).eval()
reference.load_state_dict(model.state_dict())
see_memory_usage("after init", local_rank == 0)

engine = deepspeed.init_inference(model, dtype=torch.float32, mp_size=world_size, replace_with_kernel_inject=False,
                                  max_tokens=64)
prompts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
get_accelerator().synchronize()
with torch.no_grad():
    settings = dict(attention_mask=torch.ones_like(prompts), max_new_tokens=6, do_sample=False, pad_token_id=0)
    out = engine.generate(prompts, **settings)
    want = reference.generate(prompts, **settings)
get_accelerator().synchronize()
if local_rank == 0:
    print(f"SAME {str(torch.equal(out, want)).lower()}", flush=True)  # JSON
