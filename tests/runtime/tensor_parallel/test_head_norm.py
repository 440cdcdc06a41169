"""AutoTP's planner with per-head norms (Qwen3's ``q_norm`` / ``k_norm`` over ``head_dim``): q and k
stay in o's group (split by heads, not left whole), and the norms' weights, whole on every slice,
get the gradient of every head (summed over the slices); three clipped SGD steps at tensor 2 x
data 2 give the unsharded run's losses and norm weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_world
from tests.inference.models import Attention
from tests.runtime.tensor_parallel.models import TrainableLM, rule_batch


class HeadNormAttention(Attention):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__(hidden, heads, kv_heads)
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)
        with torch.no_grad():  # not ones: a slice holding a part of their gradient would show
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.q(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


def _model() -> TrainableLM:
    torch.manual_seed(0)
    model = TrainableLM()
    for block in model.lm.blocks:
        block.attn = HeadNormAttention(32, 8, 4)
    return model


def _train(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import dslaunch

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = dslaunch.initialize(model=_model(), config=config)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    worst = 0.0
    for step in range(3):
        ids = rule_batch(step, 8, 12)
        want = ref(input_ids=ids, labels=ids)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        mine = ids[(rank // 2) * 4:(rank // 2 + 1) * 4]
        loss = engine(input_ids=mine, labels=mine)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        worst = max(worst, abs(mean.item() / world - want.item()))
    attn, ref_attn = engine.module.lm.blocks[0].attn, ref.lm.blocks[0].attn
    return {"loss": worst, "q": tuple(attn.q.weight.shape), "norms": max(
        (getattr(attn, n).weight - getattr(ref_attn, n).weight).abs().max().item() for n in ("q_norm", "k_norm"))}


def test_per_head_norms_train_as_the_unsharded_model() -> None:
    for rank, got in enumerate(run_world(_train, 4, timeout=200)):
        assert got["q"] == (16, 32), f"rank {rank}: q left whole ({got['q']})"
        assert got["loss"] <= 1e-6 and got["norms"] <= 1e-6, f"rank {rank}: {got}"
