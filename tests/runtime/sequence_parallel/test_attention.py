"""``DistributedAttention`` (``deepspeed.sequence.layer``): on a sequence split over gloo ranks it
gives each rank its positions of the whole-sequence attention, and the gradients of its query,
key and value shards, as one process computing the whole sequence does (fp32, within 1e-6 of the
largest value)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.layout import kv_replication
from tests.distributed import run_world


def _causal_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on ``[b, s, h, d]`` tensors, grouped heads allowed (a plain-torch local attention)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def _causal_sbhd_merged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Sequence first ``[s, b, h, d]`` in, heads merged ``[s, b, h*d]`` out (Megatron's layout)."""
    out = _causal_bshd(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    return out.reshape(*out.shape[:2], -1)


def _attention_world(rank: int, world: int, sp: int, heads: int, kv_heads: int, seq_first: bool) -> float:
    import torch.distributed as dist

    from dslaunch.runtime.parallel import ParallelDims, PipelineParallelGrid
    from dslaunch.sequence.layer import DistributedAttention

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    grid = PipelineParallelGrid(ParallelDims(sequence=sp).topology(world))
    group, sp_rank = grid.groups.group("sequence"), grid.groups.rank_in("sequence")
    torch.manual_seed(grid.get_data_parallel_rank())  # one sample per replica, the same on its sequence ranks
    b, s, d = 2, 8 * sp, 4
    q, k, v = (torch.randn(b, s, n, d, dtype=torch.float32) for n in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(b, s, heads, d, dtype=torch.float32)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _causal_bshd(ref_q, ref_k, ref_v)
    ref.backward(grad_out)

    mine = slice(sp_rank * s // sp, (sp_rank + 1) * s // sp)
    shards = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    if seq_first:
        layer = DistributedAttention(_causal_sbhd_merged, group, scatter_idx=2, gather_idx=0)
        out = layer(*(t.transpose(0, 1) for t in shards), 1).transpose(0, 1).reshape(b, -1, heads, d)
    else:
        layer = DistributedAttention(_causal_bshd, group, scatter_idx=2, gather_idx=1)
        out = layer(*shards, batch_dim_idx=0)
    out.backward(grad_out[:, mine])
    return max(_relative(out, ref[:, mine]),
               *(_relative(t.grad, r.grad[:, mine]) for t, r in zip(shards, (ref_q, ref_k, ref_v), strict=True)))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the largest magnitude (fp32: kernels that group heads
    differently round differently, a few units in the last place)."""
    return float((got - want).abs().max() / want.abs().max().clamp(min=1.0))


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world", "sp", "heads", "kv_heads", "seq_first"), [
    (2, 2, 4, 4, False),   # multi-head attention, batch first
    (2, 2, 4, 2, True),    # grouped heads, sequence first, output heads merged
    (2, 2, 4, 1, False),   # one key/value head for two ranks: replicated
    (4, 2, 2, 1, False),   # sp 2 x dp 2: two sequence groups
    (4, 4, 4, 2, False),   # 2 key/value heads over 4 ranks
    (4, 4, 12, 3, True),   # 3 key/value heads over 4 ranks (gcd 1: each repeated 4 times)
])
def test_distributed_attention_equals_local_attention_on_the_whole_sequence(world: int, sp: int, heads: int,
                                                                            kv_heads: int, seq_first: bool) -> None:
    errors = run_world(_attention_world, world, sp, heads, kv_heads, seq_first, timeout=120)
    assert max(errors) < 1e-6, errors


def test_kv_replication_gives_each_rank_whole_query_groups() -> None:
    assert [kv_replication(8, kv, 4) for kv in (8, 4, 2, 1)] == [1, 1, 2, 4]
    assert kv_replication(12, 3, 4) == 4 and kv_replication(12, 6, 4) == 2
    with pytest.raises(UsageError, match="6 attention heads do not split over a sequence group of 4"):
        kv_replication(6, 2, 4)
