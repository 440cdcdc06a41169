"""What a Megatron-style mpu answers for the tensor axis (the one lookup order), and which
parameters this rank counts in the global gradient norm.

An mpu may be Megatron's (``get_tensor_model_parallel_*``), DeepSpeed's pipeline grid
(``get_slice_parallel_*``: its tensor slices) or an older one with only ``get_model_parallel_*``
(where model parallel means tensor parallel). DeepSpeed asks in that order; so does every
dslaunch module that needs the tensor group (activation checkpointing, ``deepspeed.utils.groups``,
inference), through ``tensor_axis``.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["tensor_axis", "has_tensor_axis", "counted_in_norm", "gradient_reduce_group", "holds_model_parts",
           # DeepSpeed's ``deepspeed.utils.bwc`` over the same lookup
           "bwc_tensor_model_parallel_rank", "bwc_tensor_model_parallel_world_size",
           "bwc_tensor_model_parallel_group", "bwc_pipeline_parallel_world_size", "bwc_pipeline_parallel_group"]

What = Literal["group", "rank", "world_size"]
_ORDER = ("get_tensor_model_parallel_{}", "get_slice_parallel_{}", "get_model_parallel_{}")


def _method(mpu: Any, what: What, order: tuple[str, ...] = _ORDER) -> Any:
    """The first of ``order``'s methods (``what`` filled in) that ``mpu`` has, or None."""
    for name in order:
        get = getattr(mpu, name.format(what), None)
        if callable(get):
            return get
    return None


def has_tensor_axis(mpu: Any, what: What = "group") -> bool:
    """Whether ``mpu`` answers ``what`` of the tensor axis under any of the three names."""
    return _method(mpu, what) is not None


def tensor_axis(mpu: Any, what: What) -> Any:
    """The tensor-parallel ``group``, ``rank`` or ``world_size`` of ``mpu``.

    Raises:
        AttributeError: the mpu has none of the three methods (the caller says what it needed).
    """
    get = _method(mpu, what)
    if get is None:
        raise AttributeError(f"the mpu {type(mpu).__name__} has no get_model_parallel_{what}()")
    return get()


def counted_in_norm(param: Any, tensor_rank: int) -> bool:
    """Whether this rank counts ``param``'s gradient in the global norm, so that every distinct
    parameter counts once over the replica (DeepSpeed's rule):

    - a tied pipeline weight's copy above the tie's lowest stage (``ds_pipe_replicated``) does not:
      the lowest stage counts the summed gradient;
    - a parameter every tensor slice holds whole (a layer norm) counts on tensor rank 0 only; a
      tensor-parallel shard (``tensor_model_parallel`` or ``model_parallel`` set, as Megatron
      marks them) counts on every slice, the shards summing to the whole.
    """
    if getattr(param, "ds_pipe_replicated", False):
        return False
    sharded = getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
    return tensor_rank == 0 or bool(sharded)


def gradient_reduce_group(mpu: Any) -> Any:
    """Where dense gradients average and ZeRO partitions: data x sequence (DeepSpeed's
    ``seq_data_parallel_group``) for an mpu with a sequence axis, else its data-parallel group.

    Each sequence rank of a sample backpropagates the whole sequence's loss through an all-reduce
    (``sequence_parallel.loss``), so it holds N times its part of the gradient: the average over
    data x sequence is the parts summed, averaged over the samples.
    """
    get = getattr(mpu, "get_sequence_data_parallel_group", None)
    return get() if callable(get) else mpu.get_data_parallel_group()


def holds_model_parts(mpu: Any) -> bool:
    """Whether the ranks of one replica hold different parts of the model (pipeline stages, tensor
    slices), so that a checkpoint names its files by their coordinates. Sequence ranks hold the same
    model, as data ranks do: ZeRO partitions over both (``gradient_reduce_group``), and a job with
    only those axes saves as a data-parallel one. A Megatron-style mpu without a topology counts as
    holding parts."""
    topology = mpu.topology() if hasattr(mpu, "topology") else None
    if topology is None:
        return True
    return any(size > 1 for axis, size in topology.shape().items() if axis not in ("data", "sequence"))


# ---- DeepSpeed's deepspeed.utils.bwc: no mpu means no model parallelism ----
_PIPE = ("get_pipeline_model_parallel_{}", "get_pipe_parallel_{}")


def _tensor(mpu: Any, what: What, alone: Any) -> Any:
    return alone if mpu is None else tensor_axis(mpu, what)


def bwc_tensor_model_parallel_rank(mpu: Any = None) -> int:
    """This rank's index on the tensor axis (0 without an mpu)."""
    return _tensor(mpu, "rank", 0)


def bwc_tensor_model_parallel_world_size(mpu: Any = None) -> int:
    """The tensor axis's size (1 without an mpu)."""
    return _tensor(mpu, "world_size", 1)


def bwc_tensor_model_parallel_group(mpu: Any = None) -> Any:
    """The tensor axis's process group (None without an mpu)."""
    return _tensor(mpu, "group", None)


def bwc_pipeline_parallel_world_size(mpu: Any = None) -> int:
    """The pipeline's stage count (1 without an mpu, or one that has no pipeline)."""
    get = None if mpu is None else _method(mpu, "world_size", _PIPE)
    return 1 if get is None else get()


def bwc_pipeline_parallel_group(mpu: Any = None) -> Any:
    """The pipeline's process group (None without an mpu).

    Raises:
        AttributeError: the mpu answers no pipeline group (DeepSpeed asserts).
    """
    if mpu is None:
        return None
    get = _method(mpu, "group", _PIPE)
    if get is None:
        raise AttributeError(f"{type(mpu).__name__} answers no pipeline group (get_pipeline_model_parallel_group "
                             "or get_pipe_parallel_group)")
    return get()
