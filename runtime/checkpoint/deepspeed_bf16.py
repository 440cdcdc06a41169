"""DeepSpeed's bf16 optimizer (``BF16_Optimizer``) in a checkpoint: which parameters its files hold.

DeepSpeed 0.19.8 trains with ``BF16_Optimizer`` a bf16 model at ZeRO stage 1 with
``data_types.grad_accum_dtype: "fp32"``, and a bf16 ``PipelineModule`` at ZeRO stage 0 (Megatron-
DeepSpeed's default). Either way each data-parallel rank R writes ``bf16_zero_pp_rank_R_...`` whose
``optimizer_state_dict`` is that optimizer's ``state_dict``: per param group the rank's equal share
of the padded flat fp32 vector (``single_partition_of_fp32_groups``, padding kept), the torch
optimizer's state of it (``base_optimizer_state``) and ``param_slice_mappings`` (per group: each
parameter's name -> its ``fragment_address(numel, start)`` inside the rank's share). At stage 1
the model states name the parameters (``param_shapes``) as for any ZeRO-1 tag. At stage 0 they do
not (``param_shapes`` None, ``optimizer``: rank 0's ``BF16_Optimizer`` state dict): the names and
sizes come from the slice mappings of every rank, which is what this module reads.

Writing (``deepspeed_write``, ``checkpoint.format: "deepspeed"``): where DeepSpeed would train the
same config with ``BF16_Optimizer``, the ZeRO-1 file dslaunch builds is reshaped into that
optimizer's ``state_dict`` (``bf16_optimizer_state``), and at stage 0 the model states hold data-
parallel rank 0's copy under ``optimizer``, as DeepSpeed's save does.

DeepSpeed 0.19.8 cannot load the stage-0 tag with its optimizer state (its stage-0 path hands the
model states' one state dict where a list per rank is expected: ``KeyError: 0``); dslaunch can.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from dslaunch.errors import CheckpointError

__all__ = ["is_bf16_optimizer_state", "slice_shapes", "bf16_optimizer_state"]

_KEYS = ("single_partition_of_fp32_groups", "base_optimizer_state", "param_slice_mappings")


def is_bf16_optimizer_state(osd: Any) -> bool:
    """Whether ``osd`` is ``BF16_Optimizer.state_dict()`` (what a stage-0 tag's model states hold
    under ``optimizer``, and every ``bf16_zero_pp_rank_*`` file under ``optimizer_state_dict``)."""
    return isinstance(osd, dict) and all(k in osd for k in _KEYS)


def _fragment(address: Any, name: str, path: Path) -> tuple[int, int]:
    """``(start, numel)`` of a pickled ``fragment_address`` (read as a stand-in: its attributes)."""
    start, numel = getattr(address, "start", None), getattr(address, "numel", None)
    if not (isinstance(start, int) and isinstance(numel, int) and numel > 0 and start >= 0):
        raise CheckpointError(f"param_slice_mappings of {name!r} is not a fragment_address(numel, start)", str(path))
    return start, numel


def slice_shapes(osds: list[dict], files: list[Path], module: dict[str, torch.Tensor]
                 ) -> list[OrderedDict[str, torch.Size]]:
    """Each param group's parameters in their flat order with their shapes (from ``module`` where
    it holds the parameter, else flat: ``(numel,)``), told by every rank's ``param_slice_mappings``.

    Args:
        osds: every data-parallel rank's ``BF16_Optimizer`` state dict, in rank order.
        files: their files, to name in errors.
        module: the module's weights as far as known (a pipeline stage's are in its layer files).
    Returns:
        One ``{name: shape}`` per param group, as ``param_shapes`` of a ZeRO-1 tag would give it.
    Raises:
        CheckpointError: a mapping that is no fragment, or a parameter whose fragments leave a gap.
    """
    groups = len(osds[0]["param_slice_mappings"])
    out = []
    for g in range(groups):
        spans: dict[str, list[tuple[int, int]]] = {}
        offset = 0
        for osd, path in zip(osds, files, strict=True):
            mappings = osd["param_slice_mappings"]
            if not (isinstance(mappings, list) and len(mappings) == groups and isinstance(mappings[g], dict)):
                raise CheckpointError(f"param_slice_mappings is not one mapping per param group ({groups})", str(path))
            for name, address in mappings[g].items():
                start, numel = _fragment(address, name, path)
                spans.setdefault(name, []).append((offset + start, numel))
            offset += osd["single_partition_of_fp32_groups"][g].numel()
        shapes: OrderedDict[str, torch.Size] = OrderedDict()
        end = 0  # the optimizer lays a group's parameters one after another from 0, padding only last
        for name, parts in sorted(spans.items(), key=lambda kv: kv[1][0][0]):
            numel = sum(n for _, n in parts)
            if [a for a, _ in parts] != [end + sum(n for _, n in parts[:i]) for i in range(len(parts))]:
                raise CheckpointError(f"param group {g}: the fragments of {name!r} over the ranks' files do not "
                                      f"follow the previous parameter's (at {end}) without a gap", str(files[0]))
            end += numel
            known = module.get(name)
            shapes[name] = known.shape if known is not None and math.prod(known.shape) == numel else \
                torch.Size([numel])
        out.append(shapes)
    return out


def bf16_optimizer_state(zero12: dict, sizes: list[int]) -> dict:
    """``BF16_Optimizer.state_dict()`` from the ZeRO-1 ``state_dict`` of the same partitions
    (``deepspeed_write``): its keys only, each fp32 partition zero-padded to its whole share
    (``sizes``, per group: the padded flat vector / the ranks; DeepSpeed's ZeRO-1 drops that padding
    from the saved partition, its bf16 optimizer keeps it)."""
    fp32 = [torch.cat([t.reshape(-1), t.new_zeros(size - t.numel())])
            for t, size in zip(zero12["single_partition_of_fp32_groups"], sizes, strict=True)]
    keep = ("clip_grad", "base_optimizer_state", "group_paddings", "partition_count", "ds_version",
            "param_slice_mappings")
    return {**{k: zero12[k] for k in keep}, "single_partition_of_fp32_groups": fp32}
