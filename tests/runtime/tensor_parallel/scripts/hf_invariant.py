"""``layout_invariant`` on tiny Hugging Face Llama (GQA, eager attention) and GPT-2 (fused qkv,
Conv1D, tied lm_head) from ``hf_train.py``'s configs: 4 AdamW steps at tp 2 x dp 2 and at tp 4 x
gradient accumulation 2 (the same global batch, halves of 2 sequences), with the block on and off.
Rank 0 prints ``RESULTS {json}``: per family and mode, each degree's losses.

Usage: dslaunch --num_gpus 4 hf_invariant.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_train import CONFIGS, batch, build  # noqa: E402

import dslaunch  # noqa: E402

HALF, STEPS = 2, 4


def train(family: str, tp: int, invariant: bool) -> list[float]:
    config = {"train_micro_batch_size_per_gpu": HALF, "gradient_accumulation_steps": tp // 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 1}, "steps_per_print": 1000, "tensor_parallel": {"autotp_size": tp},
              "layout_invariant": {"enabled": invariant, "chunks": 4}}
    engine, *_ = dslaunch.initialize(model=build(family), config=config)
    losses = []
    for step in range(STEPS):
        halves = torch.zeros(2)
        for micro in range(tp // 2):  # dp 2 x gas 1 or dp 1 x gas 2: the same halves
            half = engine.grid.get_data_parallel_rank() + micro
            ids = batch(step)[half * HALF:(half + 1) * HALF]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            halves[half] = loss.detach()
        dist.all_reduce(halves, op=dist.ReduceOp.MAX)  # each half's loss, as it is
        losses.append(((halves[0] + halves[1]) / 2).item())
    return losses


def main() -> None:
    results = {f"{family}@{mode}": {tp: train(family, tp, mode == "on") for tp in (2, 4)}
               for mode in ("on", "off") for family in CONFIGS}
    if dist.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
