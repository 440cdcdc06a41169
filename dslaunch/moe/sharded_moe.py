"""``deepspeed.moe.sharded_moe``: the gate and the all-to-all layer (``dslaunch.runtime.moe``)."""

from dslaunch.runtime.comm import comm as dist
from dslaunch.runtime.moe.gate import (
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    route_slots,
    sparse_decode,
    sparse_encode,
    top1gating,
    top2gating,
    topkgating,
)
from dslaunch.runtime.moe.layer import MOELayer

# DeepSpeed's private names for the sparse dispatch helpers (its tests and gating code import them)
_route_slots, _sparse_encode, _sparse_decode = route_slots, sparse_encode, sparse_decode

# DeepSpeed's flag for the optional Tutel kernels: dslaunch has none (use_tutel is logged and ignored)
TUTEL_INSTALLED = False

# dist: DeepSpeed's module attribute; the gates call dist.all_reduce through it (its tests patch it there)
__all__ = ["dist", "TUTEL_INSTALLED", "TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "multiplicative_jitter", "gumbel_rsample"]
