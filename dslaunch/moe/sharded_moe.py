"""``deepspeed.moe.sharded_moe``: the gate and the all-to-all layer (``dslaunch.runtime.moe``)."""

from dslaunch.runtime.moe.gate import (
    TopKGate,
    gumbel_rsample,
    multiplicative_jitter,
    top1gating,
    top2gating,
    topkgating,
)
from dslaunch.runtime.moe.layer import MOELayer

__all__ = ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating", "multiplicative_jitter", "gumbel_rsample"]
