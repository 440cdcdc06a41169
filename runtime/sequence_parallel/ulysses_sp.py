"""``deepspeed.runtime.sequence_parallel.ulysses_sp``: Ulysses sequence parallelism for Hugging Face
models (ALST's ``UlyssesSPAttentionHF`` and ``UlyssesSPDataLoaderAdapter``), as accelerate's
``ParallelismConfig(sp_backend="deepspeed")`` and DeepSpeed's ALST tutorial use them.

- ``UlyssesSPAttentionHF.register_with_transformers(...)`` puts a Ulysses wrapper in place of the
  model's attention function in transformers' ``ALL_ATTENTION_FUNCTIONS`` (the model keeps its
  ``attn_implementation``, so every other code path is unchanged) and returns the mpu (a
  ``PipelineParallelGrid`` with a sequence axis) for ``deepspeed.initialize(mpu=...)``.
- ``UlyssesSPDataLoaderAdapter`` turns each batch of a loader into this rank's sequence shard
  (``batch.shard_batch``: ``shift_labels``, pad-and-mask, global ``position_ids``).
- ALST's tiling, ``TiledMLP``, ``TiledFusedLogitsLoss``, ``sequence_tiled_compute`` (and
  ``SequenceTiledCompute``), live in ``tiling.py`` and are importable from here, as in DeepSpeed.

The loss of a shard is averaged over the whole sequence by the caller (Hugging Face's Trainer
does it; in a loop of your own: ``sequence_parallel.loss.sequence_parallel_loss``).

Differences from DeepSpeed 0.19.8: a sequence length the group does not divide is padded and
masked (DeepSpeed refuses it); key/value heads are repeated for any count that divides the query
heads (DeepSpeed: ``kv_heads`` and the group size must divide one another); the module's
``num_key_value_groups`` is set only for the call, so the model still runs without sequence
parallelism; registering twice wraps the original function once.

Limitations: ``eager`` and ``flex_attention`` are refused (eager needs the 4D mask Ulysses drops;
flex needs a block mask rebuilt for the whole sequence); an ``attention_mask`` is dropped
(positions past the sequence are padding, kept out by causality), so left padding inside a
sequence is not honoured.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.nn  # noqa: F401  (transformers' SP loss calls torch.distributed.nn.functional)

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.batch import padded_length, shard_batch
from dslaunch.runtime.sequence_parallel.layout import kv_replication, replicate_kv_heads, seq_all_to_all
from dslaunch.runtime.sequence_parallel.tiling import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

__all__ = ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter", "TiledMLP", "TiledFusedLogitsLoss",
           "SequenceTiledCompute", "sequence_tiled_compute"]

_REFUSED_ATTENTION = {
    "eager": "it needs the 4D attention mask, which is quadratic in the sequence and dropped under Ulysses",
    "paged|eager": "it needs the 4D attention mask, which is quadratic in the sequence and dropped under Ulysses",
    "flex_attention": "its block mask would have to be rebuilt for the whole sequence",
}
# Hugging Face's layout around the attention function: [batch, heads, sequence, head_dim] in,
# [batch, sequence, heads, head_dim] out.
_IN_HEADS, _IN_SEQ, _OUT_SEQ, _OUT_HEADS = 1, 2, 1, 2


class UlyssesSPAttentionHF(torch.nn.Module):
    """A Hugging Face attention function (``attn(module, q, k, v, attention_mask, ...)``) over a
    sequence split between the ranks of ``process_group``: all-to-all to the head layout, ``attn``
    on the whole sequence, all-to-all back.

    Args mirror DeepSpeed's: ``attn`` the model's attention function, the head counts and size,
    ``process_group`` the sequence group; with ``seq_length_is_variable`` False each call must
    bring ``local_seq_length`` positions. ``disable_in_eval``: a module in eval mode runs ``attn``
    on its local positions (accelerate sets it for the Trainer's evaluation).

    collective: every call on every rank of ``process_group``.
    """

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group: Any, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        import torch.distributed as dist

        super().__init__()
        self.attn, self.process_group = attn, process_group
        self.world_size, self.sp_rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = attn_head_count, attn_head_size, kv_head_count
        self.kv_replication_factor = kv_replication(attn_head_count, kv_head_count, self.world_size)
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        if not self.seq_length_is_variable and query.shape[_IN_SEQ] != self.local_seq_length:
            raise UsageError(f"Ulysses: this rank got {query.shape[_IN_SEQ]} positions, registered for "
                             f"{self.local_seq_length} (seq_length {self.global_seq_length} over {self.world_size} "
                             "ranks); register with seq_length_is_variable=True for varying lengths")
        group = self.process_group
        q = seq_all_to_all(query, group, _IN_HEADS, _IN_SEQ)
        k, v = (seq_all_to_all(replicate_kv_heads(t, self.kv_replication_factor, _IN_HEADS), group, _IN_HEADS,
                               _IN_SEQ) for t in (key, value))
        if torch.is_tensor(kwargs.get("position_ids")):  # flash attention reads them (packed sequences)
            kwargs["position_ids"] = _gathered(kwargs["position_ids"], group, self.world_size)
        # the local heads group as the model's do, with fewer heads; set for this call only
        saved = getattr(module, "num_key_value_groups", None)
        module.num_key_value_groups = q.shape[_IN_HEADS] // k.shape[_IN_HEADS]
        try:
            context, weights = self.attn(module, q, k, v, None, *args, **kwargs)
        finally:
            if saved is None:
                del module.num_key_value_groups
            else:
                module.num_key_value_groups = saved
        return seq_all_to_all(context, group, _OUT_SEQ, _OUT_HEADS), weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int, seq_length: int | None = None,
                                   seq_length_is_variable: bool = True, disable_in_eval: bool = False,
                                   max_length: int | None = None) -> Any:
        """Route the model's attention through Ulysses; return the mpu for ``initialize(mpu=...)``
        (None when ``sequence_parallel_size`` is 1: nothing changes).

        Args:
            model_name_or_path: the model (any object with a Hugging Face ``config``, a PEFT
                wrapper included) or a name/path for ``AutoConfig``.
            core_attn_implementation: the model's ``attn_implementation`` (``sdpa``,
                ``flash_attention_2``/``3``, or another registered function).
            seq_length: the global sequence length when fixed (``max_length``: its old name).

        collective: every rank of the world (the grid's groups are created here).

        Raises:
            UsageError: an attention implementation that is unknown, refused or not the model's,
                heads that do not split over the group, a group size that does not divide the
                world, or a fixed length without ``seq_length``.
        """
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise UsageError("register_with_transformers: give seq_length (the fixed global sequence length) or "
                             "seq_length_is_variable=True")
        config = _text_config(model_name_or_path)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = _core_attention(ALL_ATTENTION_FUNCTIONS, core_attn_implementation, config)
        from dslaunch.runtime.parallel.grid import sequence_grid

        mpu = sequence_grid(sequence_parallel_size, key="sequence_parallel_size")
        heads = config.num_attention_heads
        local = None if seq_length_is_variable else padded_length(seq_length, sequence_parallel_size) // sequence_parallel_size
        ulysses = cls(attn, micro_batch_size, heads, getattr(config, "head_dim", None) or config.hidden_size // heads,
                      getattr(config, "num_key_value_heads", None) or heads, config.num_hidden_layers,
                      mpu.get_sequence_parallel_group(), seq_length_is_variable, local, seq_length, disable_in_eval)
        ulysses.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
            return ulysses(module, query, key, value, attention_mask, *args, **kwargs)

        ulysses_attention.ulysses = ulysses  # type: ignore[attr-defined]
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        return mpu


def _text_config(model_or_name: Any) -> Any:
    config = getattr(model_or_name, "config", None)
    if config is None:
        if not isinstance(model_or_name, str | bytes) and not hasattr(model_or_name, "__fspath__"):
            raise UsageError(f"register_with_transformers: {type(model_or_name).__name__} has no Hugging Face "
                             "config; pass the model or its name/path")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_or_name)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _core_attention(registry: Any, name: str, config: Any) -> Any:
    """The attention function ``name`` (the original if Ulysses already wraps it), checked
    against the model's."""
    if name in _REFUSED_ATTENTION:
        raise UsageError(f"Ulysses sequence parallelism with attn_implementation={name!r}: {_REFUSED_ATTENTION[name]}; "
                         "use 'sdpa' or a flash attention implementation")
    model_name = getattr(config, "_attn_implementation", None)
    if model_name is not None and model_name != name:
        raise UsageError(f"register_with_transformers: core_attn_implementation={name!r} but the model runs "
                         f"attn_implementation={model_name!r}; set both to the same value")
    if name not in registry:
        raise UsageError(f"register_with_transformers: {name!r} is not a registered attention implementation; "
                         f"choose one of {sorted(registry.valid_keys())}")
    attn = registry[name]
    wrapped = getattr(attn, "ulysses", None)
    return wrapped.attn if wrapped is not None else attn


def _gathered(positions: torch.Tensor, group: Any, ranks: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(positions) for _ in range(ranks)]
    dist.all_gather(parts, positions.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class UlyssesSPDataLoaderAdapter:
    """A loader whose every batch is a sequence shard for this rank, as DeepSpeed's adapter.

    Each refill takes one batch from ``dl`` on every rank of ``sp_group``; the group then trains on
    them one after the other, each rank on its shard of each (``batch.shard_batch``). So a loader
    of ``n`` batches gives ``n * sp_world_size`` micro steps, and the ranks of a group should read
    different samples (or see each sample ``sp_world_size`` times). Batches need ``input_ids``
    ``[batch, sequence]`` (``labels`` become ``shift_labels``; ``position_ids`` are made when
    missing); lengths may differ between batches and ranks.

    collective: ``next()`` on every rank of ``sp_group`` together.
    """

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size, self.device = dl, sp_rank, sp_group, sp_world_size, device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Gather one batch from each rank of the group and keep this rank's shard of each.

        Raises:
            StopIteration: ``dl`` is exhausted (the next ``iter`` starts a new epoch).
        """
        import torch.distributed as dist

        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        local = {k: v.cpu() if torch.is_tensor(v) else v for k, v in dict(batch).items()}
        batches: list[Any] = [None] * self.sp_world_size
        dist.all_gather_object(batches, local, group=self.sp_group)
        for whole in batches:
            shard = shard_batch(whole, self.sp_rank, self.sp_world_size)
            self.micro_batches.append({k: v.to(self.device) if torch.is_tensor(v) else v for k, v in shard.items()})
