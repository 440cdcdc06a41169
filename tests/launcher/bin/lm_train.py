#!/usr/bin/env python3
"""A tiny language-model job on the engine, for the live rates: token ids in, ``STEPS`` steps
(default 6) of ``SLEEP`` seconds each (default 0.1), so beats carry tokens/s and MFU."""

import os
import time

import torch
from torch import nn

import dslaunch


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 8) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "dist_init_timeout": 60, "steps_per_print": 1000}
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(int(os.environ.get("STEPS", "6"))):
        loss = engine(torch.randint(0, 32, (2, 16)))  # 32 tokens a step on each rank
        engine.backward(loss)
        engine.step()
        time.sleep(float(os.environ.get("SLEEP", "0.1")))


if __name__ == "__main__":
    main()
