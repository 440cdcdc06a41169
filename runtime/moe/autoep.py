"""AutoEP: a Hugging Face MoE model's expert blocks converted to expert-parallel form at
``initialize`` (DeepSpeed 0.19.2+'s ``expert_parallel`` block).

``convert_for_expert_parallel`` finds the blocks (``autoep_presets.py``) and replaces each by an
``AutoEPMoE``: a ``MOELayer`` (``layer.py``: dispatch by all-to-all over the expert group, local
experts, combine) whose gate is the model's own router and whose experts are this rank's
``num_experts / autoep_size`` slices of the fused expert weights (``grouped_experts.py``). Every
rank must build the same model (same seed or the same checkpoint) before ``initialize``.

No token is dropped, as in the Hugging Face model, so the outputs and gradients are those of the
unconverted model: each rank sends each expert exactly its routes (``autoep_dispatch.py``: a small
all-to-all of the counts, then one of variable sizes), or, with ``padded``, ``MOELayer``'s
dispatch gives every expert as many slots as the busiest expert of the group receives. The
router's top-k and normalisation are the model's (its router module runs unchanged, which also
keeps ``output_router_logits`` and the auxiliary loss working); a router that returns only logits is routed by the preset's rule
(softmax or sigmoid, top-k, renormalised when ``route_norm``).

Names: a converted block keeps its path; its router is ``<block>.gate.router`` and its experts are
``<block>.experts`` (``MOELayer``'s name), whose weights keep the model's names
(``<block>.experts.gate_up_proj``) with ``num_experts / autoep_size`` rows: experts
``[ep_rank * n, (ep_rank + 1) * n)`` of the model's. ``state_dict()`` speaks the unconverted
model's layout (``autoep_state.py``: whole experts, the router under its name; collective on the
expert group), so what the Trainer saves loads with ``from_pretrained``.

Beside tensor slices (``tensor_parallel.autotp_size``, or an mpu with a tensor axis) the block is
DeepSpeed's AutoEP+AutoTP folding: the expert groups are neighbouring ranks of the tensor x data
mesh (``folding.py``'s tables), AutoTP leaves the block's router and experts whole
(``tensor_parallel/training.py``), and each tensor slice sends its share of every expert's routes
and gathers the others' back (``autoep_folded.py``). ``folding_group_handles`` then names the
layer's groups (DeepSpeed's ``FoldingGroupHandles``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
from dslaunch.runtime.moe import autoep_state
from dslaunch.runtime.moe.autoep_dispatch import dispatch_exact
from dslaunch.runtime.moe.autoep_folded import dispatch_folded
from dslaunch.runtime.moe.autoep_presets import LayerSpec, detect
from dslaunch.runtime.moe.autoep_spec import MoELayerSpec
from dslaunch.runtime.moe.folding import FoldingGroupHandles
from dslaunch.runtime.moe.gate import Routes, _busiest
from dslaunch.runtime.moe.grouped_experts import GroupedExperts
from dslaunch.runtime.moe.layer import MOELayer
from dslaunch.runtime.moe.tensor_slices import TensorSlices

__all__ = ["AutoEP", "AutoEPMoE", "RouterGate", "convert_for_expert_parallel", "folding_handles"]

log = logging.getLogger(__name__)


class RouterGate(torch.nn.Module):
    """The model's router as a ``MOELayer`` gate: its top-k choice, with a slot for every route.

    Args:
        router: the block's router module; Hugging Face 5's return ``(logits, scores, indices)``,
            a plain linear router returns logits (then ``score_func``, ``top_k``, ``route_norm``
            and ``route_scale`` route them).
        num_experts: experts of the layer (over the expert group).
    """

    def __init__(self, router: torch.nn.Module, num_experts: int, top_k: int, score_func: str = "softmax",
                 route_norm: bool = True, route_scale: float = 1.0) -> None:
        super().__init__()
        self.router = router
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.ep_group: Any = None

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group

    def _choose(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``(scores, indices)`` ``[S, k]`` of the router's choice."""
        out = self.router(tokens)
        if isinstance(out, tuple):
            return out[1], out[2]
        logits = out.float()
        probs = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        scores, indices = probs.topk(self.top_k, dim=-1)
        if self.route_norm:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores * self.route_scale, indices

    def route(self, tokens: Tensor, used_token: Tensor | None = None) -> Routes:
        """Every route of every token placed: expert ``e``'s routes take its slots in route-major
        order; the capacity is the busiest expert's count over the expert group (collective there)."""
        scores, indices = self._choose(tokens)
        experts = indices.t().long()  # [k, S], route-major as MOELayer moves tokens
        onehot = F.one_hot(experts.reshape(-1), self.num_experts)
        counts = onehot.sum(dim=0)
        locations = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1).reshape(experts.shape)
        capacity = _busiest(counts, self.ep_group)
        return Routes(scores.new_zeros(()), max(capacity, 1), self.num_experts, experts, locations, scores.t(),
                      counts.detach())


class AutoEPMoE(MOELayer):
    """A converted MoE block (DeepSpeed's ``AutoEPMoELayer``): the model's router, this rank's
    experts (``ep_rank``'s slice of ``source_module``'s), the shared experts if any.

    ``forward(hidden_states)`` returns the block's output, shaped as its input, as the Hugging Face
    block does. collective: the expert group (every rank of it calls each layer, each step).
    """

    def __init__(self, spec: LayerSpec | MoELayerSpec, source_module: torch.nn.Module, ep_size: int, ep_rank: int,
                 config: ExpertParallelConfig, jitter_noise: float = 0.0) -> None:
        spec = spec.layer_spec() if isinstance(spec, MoELayerSpec) else spec  # DeepSpeed's record of the block
        preset, block = spec.preset, source_module
        local = spec.num_experts // ep_size
        source = getattr(block, preset.experts)
        names = (preset.w1, preset.w2, preset.w3)
        first = ep_rank * local
        from dslaunch.runtime.zero.partition_parameters import GatheredParameters

        whole = [getattr(source, name) for name in names if name is not None]
        with GatheredParameters(whole):  # built under zero.Init: whole again for the slice (collective)
            weights = {name: w[first:first + local].detach().clone().requires_grad_(w.requires_grad)
                       for name, w in zip(filter(None, names), whole, strict=True)}
        act_fn = getattr(source, "act_fn", None)
        act_fn = torch.nn.SiLU() if act_fn is None else act_fn
        group_name = f"ep_size_{ep_size}"
        router = getattr(block, preset.router)
        gate = RouterGate(router, spec.num_experts, spec.top_k, spec.score_func, spec.route_norm, spec.route_scale)
        super().__init__(gate, GroupedExperts(weights, names, act_fn, config.use_grouped_mm, group_name),  # type: ignore[arg-type]
                         group_name, ep_size, local)
        self.num_experts, self.ep_rank = spec.num_experts, ep_rank
        self.router_name, self.experts_name = preset.router, preset.experts
        self.jitter_noise = jitter_noise
        self.padded = False
        """True: ``MOELayer``'s dispatch (every expert padded to the busiest one's rows); False
        (default): ``autoep_dispatch.py``'s exact counts, the same result with fewer bytes."""
        self._local_layout = False  # autoep_state.local_layout: state_dict() keeps this rank's rows
        self.folding_group_handles: FoldingGroupHandles | None = None
        """The folded groups beside tensor slices (DeepSpeed's attribute); None when not folded."""
        self.tp_group: Any = None
        self._folded_ranks: tuple[int, ...] = ()
        self.register_state_dict_post_hook(autoep_state.save_hook)
        self.register_load_state_dict_pre_hook(autoep_state.load_hook)
        self.shared_names = (preset.shared_experts, preset.shared_experts_gate)
        for name in self.shared_names:
            if name is not None and getattr(block, name, None) is not None:
                self.add_module(name, getattr(block, name))

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False,
                                  folding_group_handles: FoldingGroupHandles | None = None) -> None:
        """Make (once per size) the expert and expert-data groups and take this layer's expert group;
        beside tensor slices also the tensor group its routes split over (``folding_group_handles``
        given: those groups, as DeepSpeed's folded engine passes them). The engine calls it.
        collective: all ranks (none with ``folding_group_handles``)."""
        from dslaunch.runtime.parallel import deepspeed_groups as groups

        if folding_group_handles is not None:
            self._bind_folding(folding_group_handles)
            return
        groups._create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self._set_ep_group(groups._get_expert_parallel_group(self.ep_group_name))
        if groups.get_tensor_model_parallel_world_size() > 1:
            self._bind_folding(folding_handles(self.ep_size))

    def _bind_folding(self, handles: FoldingGroupHandles) -> None:
        self.folding_group_handles, self.tp_group = handles, handles.tp_group
        self.ep_group_name = handles.ep_group_name
        self._set_ep_group(handles.ep_group)
        self._folded_ranks = handles.tp_ranks  # the slice index is read at the first forward

    def _slices(self) -> TensorSlices:
        """The tensor slices this block's routes split over (size 1: not folded)."""
        if self.folding_group_handles is None:
            return TensorSlices()
        if self.tensor_slices.size == 1:
            from dslaunch.runtime.comm import comm

            ranks = self._folded_ranks
            self.tensor_slices = TensorSlices(self.tp_group, len(ranks), ranks.index(comm.get_rank()))
        return self.tensor_slices

    def _exact(self, hidden_states: Tensor) -> Tensor:
        """The routed experts' output by ``autoep_dispatch.dispatch_exact`` (no padding)."""
        if self.ep_size > 1 and self.ep_group is None:
            return super().forward(hidden_states)  # MOELayer's refusal: no expert group yet
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores, indices = self.gate._choose(tokens)
        experts = indices.t().long()
        self.l_aux = scores.new_zeros(())
        self.exp_counts = torch.bincount(experts.reshape(-1), minlength=self.num_experts).detach()
        slices = self._slices()
        if slices.size > 1:
            return dispatch_folded(self, tokens, experts, scores.t(), slices).reshape(hidden_states.shape)
        return dispatch_exact(self, tokens, experts, scores.t()).reshape(hidden_states.shape)

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:  # type: ignore[override]
        if self.training and self.jitter_noise > 0:  # Mixtral's router jitter, as its block applies it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        if self.padded:
            self._set_tensor_slices(self._slices())  # MOELayer's split of the slots over the slices
        output = super().forward(hidden_states) if self.padded else self._exact(hidden_states)
        shared_name, gate_name = self.shared_names
        shared = getattr(self, shared_name) if shared_name is not None and hasattr(self, shared_name) else None
        if shared is not None:
            extra = shared(hidden_states)
            if gate_name is not None and hasattr(self, gate_name):
                extra = torch.sigmoid(getattr(self, gate_name)(hidden_states)) * extra
            output = output + extra
        return output


class AutoEP:
    """DeepSpeed's ``AutoEP(model, config)``: ``ep_parser()`` finds the MoE blocks,
    ``replace_moe_layers(specs, ep_size, ep_rank)`` converts them in place."""

    def __init__(self, model: torch.nn.Module, config: ExpertParallelConfig) -> None:
        self.model, self.config = model, config

    def ep_parser(self) -> list[LayerSpec]:
        """The blocks to convert (``autoep_presets.detect``; raises its ``ConfigError``)."""
        return detect(self.model, self.config)

    def replace_moe_layers(self, specs: list[LayerSpec], ep_size: int, ep_rank: int) -> dict[int, torch.nn.Parameter]:
        """Replace each block by an ``AutoEPMoE`` holding expert rank ``ep_rank``'s experts.

        Returns:
            For each replaced expert weight (by ``id``) the local weight holding this rank's slice.
        """
        jitter = float(getattr(getattr(self.model, "config", None), "router_jitter_noise", 0.0) or 0.0)
        replaced: dict[int, torch.nn.Parameter] = {}
        for spec in specs:
            parent_name, _, child = spec.name.rpartition(".")
            parent = self.model.get_submodule(parent_name)
            block = getattr(parent, child)
            layer = AutoEPMoE(spec, block, ep_size, ep_rank, self.config, jitter)
            source = getattr(block, spec.preset.experts)
            for name in filter(None, (spec.preset.w1, spec.preset.w2, spec.preset.w3)):
                replaced[id(getattr(source, name))] = getattr(layer.experts, name)
            setattr(parent, child, layer)
        return replaced


def folding_handles(ep_size: int) -> FoldingGroupHandles:
    """This rank's folded groups beside the job's tensor slices: the tensor and data groups of the
    mpu, the ``ep_size_<N>`` expert and expert-data groups (made before), checked against the
    folding tables (``folding.py``).

    Raises:
        ConfigError: the sizes do not fold (pipeline stages, a size that does not divide), or the
            expert groups were made in another layout (tensor-sliced ``MoE`` layers of that size).
    """
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.comm import comm
    from dslaunch.runtime.moe.folding import build_folding_spec, local_folding_ranks, validate_folding_global
    from dslaunch.runtime.parallel import deepspeed_groups as groups
    from dslaunch.runtime.parallel.mpu import bwc_pipeline_parallel_world_size

    world, rank, name = comm.get_world_size(), comm.get_rank(), f"ep_size_{ep_size}"
    tp = groups.get_tensor_model_parallel_world_size()
    try:
        spec = build_folding_spec(world_size=world, pp_size=bwc_pipeline_parallel_world_size(groups.mpu),
                                  tp_size=tp, ep_size=ep_size)
        validate_folding_global(spec)
    except ValueError as err:
        raise ConfigError(str(err), key="expert_parallel.autoep_size") from None
    local = local_folding_ranks(rank, spec)
    made = {"tp": groups.get_tensor_model_parallel_group(), "dense_dp": groups._get_data_parallel_group(),
            "ep": groups._get_expert_parallel_group(name), "edp": groups._get_expert_data_parallel_group(name)}
    for kind, group in made.items():
        have = tuple(comm.get_all_ranks_from_group(group))
        if tuple(sorted(have)) != tuple(sorted(local[kind])):
            raise ConfigError(f"{ep_size}: this rank's {kind} group is {list(have)} but AutoEP folded with AutoTP "
                              f"needs {list(local[kind])} (were {name}'s groups made for tensor-sliced MoE layers?)",
                              key="expert_parallel.autoep_size")
    return FoldingGroupHandles(spec, made["tp"], made["dense_dp"], made["ep"], made["edp"], name,
                               local["tp"], local["dense_dp"], local["ep"], local["edp"])


def convert_for_expert_parallel(model: torch.nn.Module, cfg: ExpertParallelConfig, data_before_expert: bool = False
                                ) -> dict[int, torch.nn.Parameter]:
    """Replace ``model``'s MoE blocks (in place) by ``AutoEPMoE`` layers holding this rank's experts.

    Args:
        model: the whole Hugging Face model, the same on every rank.
        cfg: the ``expert_parallel`` block (enabled).
        data_before_expert: ``use_data_before_expert_parallelism`` (the layout of the expert groups).

    Returns:
        For each replaced expert weight (by ``id``) the local weight that holds this rank's slice.

    Raises:
        ConfigError: no MoE block found, ``autoep_size`` not dividing the world or an expert
            count, or a routing key unlike the model's router (``autoep_presets.detect``).

    collective: every rank (the expert groups are made here).
    """
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.comm import comm
    from dslaunch.runtime.parallel import deepspeed_groups as groups

    auto = AutoEP(model, cfg)
    specs = auto.ep_parser()
    world = comm.get_world_size() if comm.is_initialized() else 1
    if world % cfg.autoep_size:
        raise ConfigError(f"{cfg.autoep_size} does not divide the world of {world} ranks; use a divisor",
                          key="expert_parallel.autoep_size")
    groups._create_expert_and_data_parallel(cfg.autoep_size, use_data_before_expert_parallel_=data_before_expert)
    if groups.get_tensor_model_parallel_world_size() > 1:
        folding_handles(cfg.autoep_size)  # refuses a layout that does not fold, before any block changes
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{cfg.autoep_size}")
    replaced = auto.replace_moe_layers(specs, cfg.autoep_size, ep_rank)
    log.info("AutoEP: %d MoE blocks converted; %d of %d experts on each of %d expert-parallel ranks (this one: %d)",
             len(specs), specs[0].num_experts // cfg.autoep_size, specs[0].num_experts, cfg.autoep_size, ep_rank)
    return replaced
