"""An AutoTP engine's tag in DeepSpeed 0.19's AutoTP layout (``checkpoint.format: "deepspeed"``).

Owns re-cutting the engine's state into the slices DeepSpeed's AutoTP would hold
(``deepspeed_tp_cuts``) for ``deepspeed_write``, which writes them as DeepSpeed does for tensor
rank T: ``mp_rank_TT_model_states.pt`` (from data-parallel rank 0 of T: T's slice of every weight,
``mp_world_size`` and ``tp_degree`` the tensor degree, ``dp_world_size`` the data degree and
``universal_checkpoint_info`` with the slice map) and every data-parallel rank D's
``zero_pp_rank_D_mp_rank_TT_optim_states.pt`` (ZeRO-1/2: T's slices flattened and partitioned over
the data-parallel group, as a plain tag's). At ZeRO-0 the model-states file holds T's client
optimizer state (DeepSpeed numbers it by position).

dslaunch's planner may cut a layer elsewhere than DeepSpeed (it splits the embedding and
``lm_head`` over the vocabulary; DeepSpeed leaves them whole): every rank gathers each tensor
rank's slices of the weights, fp32 masters and Adam moments, joins them whole by dslaunch's own
layout (``model.ds_tensor_layout``) and cuts DeepSpeed's slice out of the whole
(``reshard.by_slices``), so the tag is DeepSpeed's whatever dslaunch's cut.

Limitations: ZeRO-3 (DeepSpeed's ``zero_pp_rank_D_mp_rank_TT_model_states.pt``) is not written;
every rank holds the whole model's state while saving (host memory); a model DeepSpeed would cut
otherwise than by its heuristic (``deepspeed_tp_cuts``) is refused in one line.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_constants import UNIVERSAL_CHECKPOINT_INFO
from dslaunch.runtime.checkpoint.deepspeed_tp_cuts import checkpoint_info, deepspeed_cuts, slice_layout
from dslaunch.runtime.checkpoint.parts import CheckpointParts
from dslaunch.runtime.checkpoint.reshard import by_slices, cut_slice, join_slices

__all__ = ["AutoTPSlices", "autotp_slices"]


@dataclass(frozen=True)
class AutoTPSlices:
    """This rank's share of a DeepSpeed AutoTP tag: DeepSpeed's tensor rank, the param groups and
    module state of its slices, and the slice map."""

    rank: int
    degree: int
    groups: list[dict]
    module: OrderedDict
    info: dict

    def model_states(self, state: dict) -> dict:
        """A plain tag's model states (``deepspeed_write``) as tensor rank ``rank``'s."""
        out = {**state, "module": self.module, "mp_world_size": self.degree,
               "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": self.degree},
               UNIVERSAL_CHECKPOINT_INFO: self.info}
        if out.get("frozen_param_fragments"):  # DeepSpeed's slices of the frozen weights too
            out["frozen_param_fragments"] = OrderedDict((n, self.module[n]) for n in out["frozen_param_fragments"])
            out["frozen_param_shapes"] = OrderedDict((n, torch.Size(self.module[n].shape))
                                                     for n in out["frozen_param_shapes"])
        return out


def _cpu(groups: list[dict]) -> list[dict]:
    return [{**g, "master": g["master"].detach().cpu(),
             "optim_state": {k: v.detach().cpu() for k, v in g["optim_state"].items()}} for g in groups]


def autotp_slices(parts: CheckpointParts, groups: list[dict], module_sd: Callable[[], dict]) -> AutoTPSlices:
    """This rank's DeepSpeed slices (the module docstring).

    Args:
        groups: this tensor rank's param groups, whole over its data-parallel ranks.
        module_sd: this rank's module state dict (dslaunch's slices).
    Raises:
        CheckpointError: ZeRO-3, or a model DeepSpeed's AutoTP cuts otherwise (names the layer).

    collective: every rank (each one's slices are all-gathered).
    """
    place = parts.placement
    assert place is not None and place.tensors is not None
    if int(parts.zero.stage) == 3:
        raise CheckpointError('checkpoint.format "deepspeed" cannot save AutoTP training at ZeRO stage 3 yet: use '
                              'stage 1 or 2, or format "dslaunch"')
    transposed = [n for n, e in place.tensors.items() if len(e) > 3 and e[3]]
    if transposed:
        raise CheckpointError(f'checkpoint.format "deepspeed" cannot save the Conv1D layer {transposed[0]!r} under '
                              'AutoTP yet: use format "dslaunch"')
    rank, degree = place.coord.get("model", 0), place.shape.get("model", 1)
    local = OrderedDict((k, v.detach().cpu()) for k, v in module_sd().items())
    everyone = parts.io.comm.all_gather_object((rank, _cpu(groups), dict(place.tensors), local))
    by_rank = {}
    for r, g, layout, sd in everyone:
        by_rank.setdefault(r, (g, layout, sd))
    saved = [by_rank[r] for r in range(degree)]
    layouts = [layout for _, layout, _ in saved]
    whole = OrderedDict((k, join_slices([sd[k] for _, _, sd in saved], layouts, k) if k in layouts[0] else v)
                        for k, v in local.items())
    shapes = {k: tuple(v.shape) for k, v in whole.items()}
    cuts = deepspeed_cuts(parts.module, shapes, degree, parts.ds_config.get("tensor_parallel") or {})
    mine = slice_layout(cuts, shapes, rank)
    state = by_slices([{"stage": 0, "world_size": 0, "groups": g} for g, _, _ in saved], layouts, mine)
    module = OrderedDict((k, cut_slice(v, mine[k]).clone() if k in mine else v) for k, v in whole.items())
    params = OrderedDict((n, shapes[n]) for n, _ in parts.module.named_parameters() if n in shapes)
    return AutoTPSlices(rank, degree, state["groups"], module, checkpoint_info(params, cuts, degree))
