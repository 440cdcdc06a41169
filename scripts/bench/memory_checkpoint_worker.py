#!/usr/bin/env python3
"""The training job of ``memory_checkpoint_bench.py``: an MLP of ``--layers`` Linear(H, H) layers
(30 x 2048: ~126M parameters; one sample per rank) or, with ``--model gpt``, a GPT-2-small-shaped
transformer (124M parameters: 12 layers, width 768, 12 heads, vocabulary 50257, tied embedding;
``--batch`` sequences of ``--seq`` random tokens per rank), trained with ZeRO-1 and AdamW.

``--memory_every K``: the ``memory_checkpoint`` block (snapshots every K steps into ``--memory_dir``);
``--save_every K``: a storage checkpoint into ``--ckpt`` every K steps. Rank 0 prints
``init_s=<s> resumed_at=<step>`` once (the time ``initialize()`` took: in a restarted run it
includes the resume) and ``step=<N> end=<time.time()> dt=<s> block=<s>`` for every step (dt includes the
snapshot's share of the step; block: the time the training thread spent starting a snapshot or
waiting for its copy in that step), and at the end ``shard_copy_s=<s>`` (one copy of rank 0's ZeRO
shard into ready host buffers).

``--pairs P`` (with ``--memory_every K``): after two warm-up snapshots, 2P blocks of K steps that
alternate snapshots on and off (on-off, then off-on, ...: pairing cancels the drift of a shared
machine); an "on" block takes one snapshot at its first step, and every block ends by waiting for
the snapshot in flight, so a block holds the whole of its snapshot's cost. Rank 0 prints
``block=<i> on=<0|1> wall=<s> cpu=<s> published=<0|1>`` per block: the wall time and the process
CPU time (all of its threads: the writer thread and gloo's I/O threads too), each the mean over the
ranks, and whether the block's snapshot is published in rank 0's store.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import dslaunch
from dslaunch.runtime.checkpoint.memory import TAG_PREFIX


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gpt_layers", type=int, default=12)  # smaller only for the bench's short test
    p.add_argument("--gpt_width", type=int, default=768)
    p.add_argument("--pairs", type=int, default=0)
    p.add_argument("--memory_every", type=int, default=0)
    p.add_argument("--memory_dir", default="/dev/shm")
    p.add_argument("--save_every", type=int, default=0)
    p.add_argument("--ckpt")
    p.add_argument("--local_rank", type=int)
    args = p.parse_args()
    torch.manual_seed(0)
    model = GPT(width=args.gpt_width, layers=args.gpt_layers) if args.model == "gpt" else nn.Sequential(*[nn.Linear(args.hidden, args.hidden)
                                                               for _ in range(args.layers)])
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 100000,
              "dist_init_timeout": 300}
    if args.memory_every:
        config["memory_checkpoint"] = {"enabled": True, "interval": args.memory_every, "dir": args.memory_dir}
    t0 = time.perf_counter()
    engine, _, _, _ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    if engine.global_rank == 0:
        print(f"init_s={time.perf_counter() - t0:.3f} resumed_at={engine.global_steps} world={engine.world_size}",
              flush=True)
    g = torch.Generator().manual_seed(engine.global_rank)
    if args.model == "gpt":
        def train_step() -> None:
            engine.backward(engine(torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)))
            engine.step()
    else:
        def train_step() -> None:
            engine.backward(engine(torch.randn(1, args.hidden, generator=g)).pow(2).mean())
            engine.step()
    if args.pairs:
        _interleaved(engine, train_step, args.memory_every, args.pairs)
        return
    blocked = _time_snapshots(engine)
    while engine.global_steps < args.steps:
        start = time.perf_counter()
        before = blocked()
        train_step()
        if args.save_every and engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt)
        if engine.global_rank == 0:
            print(f"step={engine.global_steps} end={time.time():.3f} dt={time.perf_counter() - start:.4f} "
                  f"block={blocked() - before:.4f}", flush=True)
    if engine.global_rank == 0:
        print(f"shard_copy_s={_shard_copy_s(engine):.4f}", flush=True)


VOCAB = 50257


class _Block(nn.Module):
    """A pre-norm transformer layer: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 small's shape (124M parameters); returns the next-token loss of a batch of token ids."""

    def __init__(self, context: int = 1024, width: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(context, width)
        self.layers = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for table in (self.tokens, self.positions):  # GPT-2's scale: the first loss is ~ln(VOCAB)
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        logits = self.norm(x) @ self.tokens.weight.t()  # the output layer is the embedding (tied)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _interleaved(engine, train_step, every: int, pairs: int) -> None:
    """Blocks of ``every`` steps, snapshots on and off in turn (see the module docstring)."""
    mem = engine.memory_checkpoint
    if mem is None or not every:
        raise SystemExit("--pairs needs --memory_every (and the dslaunch launcher)")
    snap_at = [-1]
    mem.due = lambda steps: steps == snap_at[0]  # the engine's own path takes the snapshot
    for _ in range(2):  # the first snapshots gather the partition map and make the store's files
        snap_at[0] = engine.global_steps + 1
        train_step()
        engine.wait_for_checkpoint()
    order = [on for p in range(pairs) for on in ((True, False) if p % 2 == 0 else (False, True))]
    for i, on in enumerate(order):
        snap_at[0] = engine.global_steps + 1 if on else -1
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(every):
            train_step()
        engine.wait_for_checkpoint()
        spent = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
        torch.distributed.all_reduce(spent)
        if engine.global_rank == 0:
            wall_s, cpu_s = (spent / engine.world_size).tolist()
            published = on and (mem.store.root / f"{TAG_PREFIX}{snap_at[0]}").is_dir()
            print(f"block={i} on={int(on)} wall={wall_s:.4f} cpu={cpu_s:.4f} published={int(published)}", flush=True)


def _time_snapshots(engine):
    """The seconds the training thread spent in memory snapshots so far: starting them, and the
    optimizer steps that waited for a snapshot's copy (``Checkpointer.gate_wait_s``)."""
    mem, spent = engine.memory_checkpoint, [0.0]
    if mem is None:
        return lambda: 0.0
    snapshot = mem.snapshot

    def timed(parts) -> None:
        t = time.perf_counter()
        snapshot(parts)
        spent[0] += time.perf_counter() - t

    mem.snapshot = timed
    return lambda: spent[0] + engine.checkpoint_parts().io.gate_wait_s


def _shard_copy_s(engine) -> float:
    """One copy of this rank's ZeRO shard (fp32 masters and moments) into ready host buffers: the
    issue's bound on what a snapshot may block a step for."""
    from dslaunch.runtime.checkpoint.writer import Snapshot

    snap, state = Snapshot(), engine.zero.state_dict()
    snap.take(state)
    t = time.perf_counter()
    snap.take(state)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
