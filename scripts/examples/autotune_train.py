"""A DeepSpeed script for ``dslaunch --autotuning``: token embeddings and residual MLP blocks
trained on synthetic sequences.

Its best configuration depends on memory and speed: activations grow with the micro batch (and
the sequence), model states (mostly the embedding table: cheap to compute, large to keep and to
reduce) shrink with the ZeRO stage, checkpointing trades recompute for activation memory
(the blocks are checkpointed when the ds_config has an ``activation_checkpointing`` block:
``deepspeed.checkpointing.is_configured()``, as the tuner arranges), offload trades copies for
device memory. The data comes through a DataLoader, so the measurement includes loading.

    dslaunch --num_gpus 2 --autotuning tune scripts/examples/autotune_train.py \\
        --deepspeed_config scripts/examples/autotune_config.json

``--fail_micro_batch M`` raises at that micro batch and ``--hang_micro_batch M`` makes rank 0
hang there after the first step (the tests' faulty experiments).
"""

import argparse
import os
import time

import torch
from torch import nn

import dslaunch as deepspeed


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, ids, y):
        x = self.embed(ids)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if deepspeed.checkpointing.is_configured() else block(x)
        return nn.functional.mse_loss(self.head(x).mean(dim=(1, 2)), y)


class Synthetic(torch.utils.data.Dataset):
    """Random token sequences; the target is the fraction of tokens in the vocabulary's lower half."""

    def __init__(self, vocab: int, seq: int, n: int = 1 << 16):
        self.vocab, self.seq, self.n = vocab, seq, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return ids, (ids < self.vocab // 2).float().mean()


def main():
    parser = argparse.ArgumentParser(description="dslaunch autotuning example")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--fail_micro_batch", type=int, default=-1)
    parser.add_argument("--hang_micro_batch", type=int, default=-1)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = Model(args.vocab, args.width, args.depth)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=Synthetic(args.vocab, args.seq))
    micro = engine.train_micro_batch_size_per_gpu()
    if engine.global_rank == 0:
        print(f"training: ZeRO stage {engine.zero_optimization_stage()}, micro batch {micro}, "
              f"accumulation {engine.gradient_accumulation_steps()}", flush=True)
    if micro == args.fail_micro_batch:
        raise RuntimeError(f"this script fails at micro batch {micro} (--fail_micro_batch)")
    while engine.global_steps < args.steps:
        for x, y in loader:
            engine.backward(engine(x, y))
            engine.step()
            if micro == args.hang_micro_batch and engine.global_steps >= 1 and engine.global_rank == 0:
                time.sleep(3600)  # a stuck rank: the monitor's hang detection stops the experiment
            if engine.global_steps >= args.steps:
                break


if __name__ == "__main__":
    main()
