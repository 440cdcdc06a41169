"""Loading for ``init_inference`` at tp=<world size>: a model built on the meta device and filled
shard by shard from a Hugging Face safetensors directory, from a torch file named by DeepSpeed's
checkpoint description JSON, and from a checkpoint saved by dslaunch's training engine at ZeRO-3.
Each is compared with the unsharded model holding the same weights. Rank 0 prints ``RESULTS {json}``.

Usage: dslaunch --num_gpus N tp_loading.py WORKDIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as T
from tp_models import CONFIGS, build, param_bytes

import dslaunch
from dslaunch.inference import empty_init
from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 23, 7]])


def empty(family: str) -> torch.nn.Module:
    config = CONFIGS[family]()
    config._attn_implementation = "eager"
    with empty_init():
        return T.AutoModelForCausalLM.from_config(config).eval()


def compare(reference: torch.nn.Module, checkpoint: object, family: str, tp: int) -> dict:
    engine = dslaunch.init_inference(empty(family), tensor_parallel={"tp_size": tp}, checkpoint=checkpoint)
    with torch.no_grad():
        diff = float((reference(IDS).logits - engine(IDS).logits).abs().max())
    return {"max_diff": diff, "bytes": param_bytes(engine.module), "full_bytes": param_bytes(reference)}


def trained_zero3(work: Path) -> Path:
    """One ZeRO-3 training step of the tiny Llama, saved by the engine."""
    model = build("llama").train()
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    loss = engine(IDS, labels=IDS).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(work / "engine"))
    return work / "engine"


def main() -> None:
    torch.set_num_threads(1)
    work = Path([a for a in sys.argv[1:] if not a.startswith("--")][0])
    dslaunch.init_distributed()
    tp, rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for family in ("llama", "gpt2"):
        reference = build(family)
        if rank == 0:
            reference.save_pretrained(work / family, safe_serialization=True)
            torch.save(reference.state_dict(), work / f"{family}.pt")
            (work / f"{family}.json").write_text(json.dumps(
                {"type": "ds_model", "checkpoints": [f"{family}.pt"], "version": 1.0}))
        dist.barrier()
        results[f"{family}_safetensors"] = compare(reference, str(work / family), family, tp)
        results[f"{family}_description"] = compare(reference, str(work / f"{family}.json"), family, tp)
    saved = trained_zero3(work)
    reference = build("llama")
    reference.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(saved))
    results["llama_engine_zero3"] = compare(reference, str(saved), "llama", tp)
    results["trained_moved"] = float((reference.lm_head.weight - build("llama").lm_head.weight).abs().max())
    if rank == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
