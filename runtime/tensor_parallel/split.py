"""How DeepSpeed's AutoTP training splits one dimension over the tensor-parallel ranks
(``deepspeed.module_inject.tp_shard``): the sizes its layers (``deepspeed_layers.py``) and the
``partition_config`` rules (``partition_config.py``) cut by.

- With the model's key/value head count known (``AutoTPMeta``) and the size a multiple of it, the
  split is by whole heads: rank ``r`` of ``n`` gets ``kv // n`` heads, one more while ``r < kv % n``
  (uneven when the heads do not divide). Not for MLP layers (a name with ``mlp``, ``gate_proj``,
  ``up_proj``, ``down_proj``, ``w1``..``w3``) nor the output layer (``lm_head``, ``embed_out``).
- Otherwise near even, in units of ``tp_grain_size``: the first ranks one unit longer, the last
  rank also takes what the grain leaves.

Torch-free and rank-free: every rank computes every rank's size, so nothing is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]

_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
             "num_attention_heads", "n_heads", "attention_heads")  # DeepSpeed's probe order
_HEADS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_OUTPUT_LAYERS = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _first(config: Any, names: tuple[str, ...]) -> int | None:
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


@dataclass(frozen=True)
class AutoTPMeta:
    """One model's head geometry as the split reads it (DeepSpeed 0.19.8's ``tp_shard.AutoTPMeta``)."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config: Any, tp_grain_size: int = 1) -> AutoTPMeta:
        """The counts from a Hugging Face-style config (its ``text_config`` when it has one); an
        empty meta (even split) for ``None``."""
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        config = getattr(model_config, "text_config", None) or model_config
        return cls(_first(config, _KV_HEADS), _first(config, _HEADS), _first(config, ("n_embd", "hidden_size")),
                   tp_grain_size)


def _meta_and_name(meta: Any, name: Any) -> tuple[AutoTPMeta, str | None]:
    """0.19.8 passes ``(meta, name)``; up to 0.19.6 the third argument was the name (and the head
    count a module global): both forms are read."""
    if isinstance(meta, AutoTPMeta):
        return meta, name
    return AutoTPMeta(), meta if name is None else name


def get_shard_size(total_size: int, mp_size: int, meta: Any = None, name: str | None = None,
                   rank: int | None = None, mp_group: Any = None) -> int:
    """Rank ``rank``'s share of ``total_size`` (``rank``: within the tensor group; without it, this
    process's rank in ``mp_group``, or in the world when it is ``mp_size`` ranks).

    Raises:
        ValueError: no ``rank`` nor ``mp_group`` while the world is not ``mp_size`` ranks.
    """
    meta, name = _meta_and_name(meta, name)
    if rank is None:
        rank = _rank(mp_size, mp_group)
    kv, grain = meta.num_kv_heads, meta.tp_grain_size
    text = str(name)
    by_heads = kv is not None and total_size % kv == 0 and "mlp" not in text and text not in _OUTPUT_LAYERS \
        and not any(s in text for s in _MLP_NAMES)
    if by_heads:
        return total_size * (kv // mp_size + (1 if rank < kv % mp_size else 0)) // kv
    if total_size < grain:
        return total_size // mp_size + (1 if rank < total_size % mp_size else 0)
    units, tail = divmod(total_size, grain)
    size = (units // mp_size + (1 if rank < units % mp_size else 0)) * grain
    return size + (tail if rank == mp_size - 1 else 0)


def get_shard_size_list(total_size: int, mp_size: int, meta: Any = None, name: str | None = None) -> list[int]:
    """Every rank's share of ``total_size``, in rank order (they sum to it)."""
    return [get_shard_size(total_size, mp_size, meta, name, rank) for rank in range(mp_size)]


def _rank(mp_size: int, mp_group: Any) -> int:
    import torch.distributed as dist

    if mp_group is not None:
        return dist.get_rank(group=mp_group)
    if dist.get_world_size() != mp_size:
        raise ValueError(f"get_shard_size: pass rank= or mp_group=: the world has {dist.get_world_size()} ranks, "
                         f"not mp_size={mp_size}")
    return dist.get_rank()
