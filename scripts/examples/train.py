"""The README demo: a DeepSpeed training script that runs unchanged on dslaunch.

A tiny causal transformer learns synthetic sequences (each token is the previous one plus a
per-sequence stride, mod the vocabulary) with ZeRO-2. Written against DeepSpeed's API; the only
change is the import line. Run it with the launcher:

    dslaunch --num_gpus 2 scripts/examples/train.py --deepspeed --deepspeed_config scripts/examples/ds_config.json
"""

import argparse
import os
import time

import torch
from torch import nn

import dslaunch as deepspeed

VOCAB, SEQ, DIM = 64, 32, 64


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, tokens, targets):
        h = self.blocks(self.embed(tokens) + self.pos, mask=self.mask, is_causal=True)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


class StrideSequences(torch.utils.data.Dataset):
    """Token t+1 = token t + stride (mod VOCAB); the model must infer the stride from context."""

    def __init__(self, n=4096, seed=0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        self.data = (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


def main():
    parser = argparse.ArgumentParser(description="dslaunch demo: tiny transformer, ZeRO-2")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = TinyLM()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=StrideSequences())

    rank0 = engine.global_rank == 0
    if rank0:
        print(f"world_size={engine.world_size} zero_stage={engine.zero_optimization_stage()} "
              f"train_batch_size={engine.train_batch_size()} "
              f"params={sum(p.numel() for p in model.parameters())}", flush=True)
    started, last_log = time.perf_counter(), 0
    while engine.global_steps < args.steps:
        for tokens, targets in loader:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            step = engine.global_steps
            if rank0 and step % 10 == 0 and step != last_log:
                last_log = step
                elapsed = time.perf_counter() - started
                print(f"step {step:4d}  loss {loss.item():.4f}  lr {engine.get_lr()[0]:.2e}  "
                      f"{engine.global_samples / elapsed:7.1f} samples/s", flush=True)
            if engine.global_steps >= args.steps:
                break
    if rank0:
        print(f"done: {engine.global_steps} steps, {engine.global_samples} samples in "
              f"{time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
