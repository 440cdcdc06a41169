"""A mixture-of-experts layer with expert parallelism: DeepSpeed's ``MoE`` and ``MOELayer``.

``MoE(hidden_size, expert, num_experts, ep_size, k, ...)`` routes each token to ``k`` of
``num_experts`` copies of ``expert``. The experts are spread over the ``ep_size`` ranks of an
expert-parallel group (``num_experts / ep_size`` on each); the world's other ranks are expert-data
peers holding the same experts. ``forward`` returns ``(output, l_aux, exp_counts)``.

One step of ``MOELayer``: the gate assigns this rank's tokens to expert slots (``[E, C, M]``), an
all-to-all over the expert group sends each expert its slots from every rank of the group, the
local experts run, and a second all-to-all brings the outputs back to be weighted by the gates.
Tokens move by slot index (one ``index_add`` in, one ``index_select`` out), never through dense
``[S, E, C]`` maps: memory and time grow with ``S * k``, not ``S * E * C``.

Collective: with ``ep_size`` > 1 ``forward`` is collective on the expert group (every rank of it
must call it, with the same number of tokens); without ``drop_tokens`` the gate agrees on the
capacity with an all-reduce there too. Each all-to-all waits marked for the hang monitor with the
layer (``layer_id``: the engine numbers the layers, ``number_moe_layers``) and the expert group
(``dslaunch.utils.beat.ExpertExchange``), and the comms logger counts it.

Beside tensor parallelism (an mpu with tensor slices) the slices of a replica, which hold the same
tokens, each send only their share of every expert's slots and gather the outputs back
(``tensor_slices.py``); with ``enable_expert_tensor_parallelism`` the expert groups run over each
tensor lane and every slice runs all slots through its part of the experts (DeepSpeed's layouts).

Limitations: no Tutel (``use_tutel`` is logged and ignored, as DeepSpeed does without Tutel
installed); ``layout_invariant`` with tensor slices is refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.moe.experts import Experts
from dslaunch.runtime.moe.gate import (
    NoisyGatePolicy,
    Routes,
    TopKGate,
    route_slots,
    sparse_decode,
    sparse_encode,
)
from dslaunch.runtime.moe.layout_invariant import run_by_source
from dslaunch.runtime.moe.tensor_slices import TensorSlices, drop_tokens, gather_tokens
from dslaunch.utils.beat import ExpertExchange

__all__ = ["MoE", "MOELayer", "number_moe_layers"]

log = logging.getLogger(__name__)

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class _AllToAll(torch.autograd.Function):
    """Equal blocks of dim 0 exchanged over ``group``; the gradient takes the way back. The wait
    is marked ``names[0]`` (``names[1]`` in backward) for the hang monitor; the comms logger
    counts the exchange (``deepspeed.comm``'s ``all_to_all_single``)."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor, names: tuple[str, str]) -> Tensor:  # noqa: A002
        ctx.group, ctx.names = group, names
        input = input.contiguous()
        output = torch.empty_like(input)
        wait_all((comm.all_to_all_single(output, input, group=group, async_op=True),), names[0])
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        return None, _AllToAll.apply(ctx.group, grad, ctx.names[::-1]), None


class MOELayer(torch.nn.Module):
    """Gate, dispatch over the expert group, local experts, combine (see the module docstring).

    After ``forward``, ``l_aux`` and ``exp_counts`` hold the step's load-balancing loss and
    per-expert token counts.
    """

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int, use_tutel: bool = False) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.layout_invariant = False
        """Each source rank's block is its own expert call and the expert gradients a fixed tree over
        them (``layout_invariant.run_by_source``); set by the engine from the ``layout_invariant`` block."""
        self.layer_id: int | None = None
        """DeepSpeed's ``moe_layer_id``: this layer's index among the model's MoE layers
        (``number_moe_layers``), for the hang report; None until numbered."""
        self._waits: dict[str, tuple[str, str]] | None = None
        self.tensor_slices = TensorSlices()
        """The tensor group beside the layer (an mpu with tensor parallelism), set with the expert group."""
        self.use_tutel = False
        self.wall_clock_breakdown = False
        self.time_falltoall = self.time_salltoall = self.time_moe = 0.0
        if use_tutel:
            log.warning("MoE: use_tutel is ignored (dslaunch has no Tutel); routing without it")

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group, self._waits = ep_group, None
        self.gate._set_ep_group(ep_group)

    def _set_tensor_slices(self, slices: TensorSlices) -> None:
        """Split the slots over the tensor slices around the all-to-all (``tensor_slices.py``)."""
        self.tensor_slices = slices

    def set_layout_invariant(self, on: bool) -> None:
        """Run the experts per source block (``layout_invariant``); the engine calls it.

        Raises:
            ConfigError: ``on`` for experts other than ``Experts`` (AutoEP's grouped weights).
        """
        if on and not isinstance(self.experts, Experts):
            from dslaunch.errors import ConfigError

            raise ConfigError(f"true: {type(self.experts).__name__} (AutoEP's grouped experts) has no per-block "
                              "form yet; use deepspeed.moe.layer.MoE or disable layout_invariant",
                              key="layout_invariant.enabled")
        draws = self.gate.random_draws() if on else []
        if draws:
            log.warning("MoE layer %s: %s draw(s) from each rank's random generator, which a layout feeds other "
                        "samples: training is layout-invariant only without random routing", self.layer_id,
                        ", ".join(draws))
        self.layout_invariant = on

    def set_layer_id(self, layer_id: int) -> None:
        self.layer_id, self._waits = layer_id, None

    def _wait_names(self, phase: str) -> tuple[str, str]:
        """What a rank in this layer's ``phase`` exchange waits for, forward and backward
        (``ExpertExchange``), made once: a mark then costs no formatting."""
        if self._waits is None:
            ranks = tuple(comm.get_all_ranks_from_group(self.ep_group))

            def name(p: str) -> str:
                return str(ExpertExchange(p, self.layer_id, ranks, self.num_local_experts))

            self._waits = {p: (name(p), name(f"{p}, backward")) for p in ("dispatch", "combine")}
        return self._waits[phase]

    def _exchange(self, blocks: Tensor, phase: str) -> Tensor:
        if self.ep_size == 1:
            return blocks
        if self.ep_group is None:
            from dslaunch.errors import UsageError

            raise UsageError(f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: build the "
                             "engine with deepspeed.initialize(model=...) (or call set_deepspeed_parallelism()) first")
        return _AllToAll.apply(self.ep_group, blocks, self._wait_names(phase))

    def _source_rows(self, routes: Routes) -> Tensor:
        """How many rows each source rank of the expert group routed to each local expert, in the
        dispatch's block order (an all-to-all of this rank's kept counts; collective there). A
        gate fills an expert's slots from 0 up, so these are the block's first rows."""
        kept = routes.experts[routes.experts >= 0]
        counts = torch.bincount(kept, minlength=routes.num_experts).to(torch.int64)
        if self.ep_size == 1:
            return counts
        received = torch.empty_like(counts)
        wait_all((comm.all_to_all_single(received, counts, group=self.ep_group, async_op=True),),
                 self._wait_names("dispatch")[0])
        return received

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:  # noqa: A002 (DeepSpeed's signature)
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        width = hidden.shape[-1]
        tokens = hidden.reshape(-1, width)
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        experts, capacity = routes.num_experts, routes.capacity
        tp = self.tensor_slices
        # Tensor slices share the tokens: each sends only its share of every expert's slots (the
        # capacity padded to split evenly; an empty slot adds nothing), and gathers them back after.
        capacity = -(-capacity // tp.size) * tp.size
        slots = route_slots(routes.experts, routes.locations, experts, capacity)  # [k, S]: route 0, then 1, ...
        placed = drop_tokens(sparse_encode(tokens, slots, experts, capacity), 1, tp)
        received = self._exchange(placed, "dispatch")
        if tp.experts_sliced:  # each slice runs every slot through its part of the experts
            received = gather_tokens(received, 1, tp)
        expert_in = received.reshape(self.ep_size, self.num_local_experts, -1, width)
        self.experts.routed = (routes.experts, experts * capacity)  # the flops profiler's share
        if self.layout_invariant:
            if tp.size > 1:  # its per-source rows count whole capacities, not one slice's share
                from dslaunch.errors import ConfigError

                raise ConfigError("true: MoE layers beside tensor parallelism have no per-block form yet; "
                                  "disable layout_invariant", key="layout_invariant.enabled")
            rows = self._source_rows(routes).reshape(self.ep_size, self.num_local_experts)
            expert_out = run_by_source(self.experts.deepspeed_experts, expert_in, rows)
        else:
            expert_out = self.experts(expert_in)
        expert_out = expert_out.reshape(experts, -1, width)
        if tp.experts_sliced:
            expert_out = drop_tokens(expert_out, 1, tp)
        returned = gather_tokens(self._exchange(expert_out, "combine"), 1, tp)
        return sparse_decode(returned.reshape(experts * capacity, width), slots, routes.gates,
                             tokens.shape[0]).reshape(hidden.shape)


class MoE(torch.nn.Module):
    """DeepSpeed's mixture-of-experts layer (``deepspeed.moe.layer.MoE``).

    Args:
        hidden_size: the tokens' size, in and out.
        expert: the module each expert copies (an MLP, a Linear); its output may be a tuple
            ``(output, bias)``, of which the output is used.
        num_experts: experts in the layer, over the expert-parallel group.
        ep_size: ranks the experts are spread over (divides ``num_experts`` and the world size).
        k: experts per token (1 and 2 as DeepSpeed documents; more routes by top-k).
        capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy, drop_tokens,
            use_rts, top2_2nd_expert_sampling: the gate's (``TopKGate``).
        use_residual: Residual MoE: the output mixes the experts' and a dense copy of ``expert``
            (``mlp``) by a learned per-token softmax coefficient.
        use_tutel: ignored with a warning (no Tutel).
        enable_expert_tensor_parallelism: beside an mpu with tensor slices, the experts are
            tensor-sliced too: expert groups over each tensor lane's data ranks, every slice runs
            every slot (DeepSpeed's); without tensor parallelism it changes nothing.

    Raises:
        UsageError: ``num_experts`` not a multiple of ``ep_size``, or an unknown noisy gate policy.
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: NoisyGatePolicy = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        from dslaunch.errors import UsageError

        if ep_size < 1 or num_experts % ep_size:
            raise UsageError(f"MoE: num_experts={num_experts} must be a multiple of ep_size={ep_size}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise UsageError(f"MoE: noisy_gate_policy={noisy_gate_policy!r} is not one of "
                             f"{', '.join(map(repr, NOISY_GATE_POLICIES))}")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        log.info("MoE layer: %d experts, %d on each of %d expert-parallel ranks", num_experts,
                 self.num_local_experts, ep_size)
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts,
                                      use_tutel=use_tutel)
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (once per ``ep_size``) the expert and expert-data groups and give this layer its
        expert group. The engine calls it on every module that has it. Collective: all ranks.

        Beside an mpu with tensor slices the layer also splits its slots over them
        (``tensor_slices.py``), and its groups follow DeepSpeed's layout for
        ``enable_expert_tensor_parallelism`` (``runtime/parallel/tensor_experts.py``).
        """
        from dslaunch.runtime.parallel import deepspeed_groups as groups

        tensor = groups.get_tensor_model_parallel_world_size()
        name = self.expert_group_name
        if name not in groups._get_expert_parallel_group_dict():
            if tensor > 1 and self.enable_expert_tensor_parallelism:
                groups._create_expert_data_and_model_parallel(self.ep_size, groups.mpu,
                                                              use_data_before_expert_parallel_)
            else:
                groups._create_expert_and_data_parallel(
                    self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(name))
        if tensor > 1:
            sliced = groups.expert_home(groups.mpu).sliced(self.ep_size)
            if not sliced and _holds_tensor_slices(self.deepspeed_moe.experts):
                from dslaunch.errors import UsageError

                raise UsageError("MoE: the experts hold tensor-parallel layers (each rank a slice of every expert), "
                                 f"but their {name} groups were made for whole experts; pass "
                                 "enable_expert_tensor_parallelism=True to every MoE layer of this ep_size")
            self.deepspeed_moe._set_tensor_slices(TensorSlices(groups.get_tensor_model_parallel_group(), tensor,
                                                               groups.get_tensor_model_parallel_rank(), sliced))

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(output, l_aux, exp_counts)``; ``used_token`` (``[S]``, 0 or 1) keeps padding out of
        routing (top-1)."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _holds_tensor_slices(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` contain tensor-parallel linears (AutoTP's or Megatron-style ones)."""
    from dslaunch.runtime.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return any(isinstance(m, ColumnParallelLinear | RowParallelLinear) for m in experts.modules())


def number_moe_layers(model: torch.nn.Module) -> None:
    """Give each ``MoE`` layer of ``model`` its index among them in ``model.modules()`` order
    (DeepSpeed's ``moe_layer_id``: its checkpoints' ``layer_<id>`` and the hang report's layer)."""
    for layer_id, layer in enumerate(m for m in model.modules() if isinstance(m, MoE)):
        layer.deepspeed_moe.set_layer_id(layer_id)
