"""The ZeRO strategy: a placement and a gradient path, composed; the step every stage shares.

A strategy is a ``placement`` (where the fp32 master weights and optimizer state live:
``placement.Replicated`` or ``placement.Sharded``) and a ``gradients`` path (how gradients are kept
and reduced: ``gradients.FullGradients`` or ``sharded_gradients.ShardedGradients``). A stage
(``stage0.py`` ...) is one such pair; ``registry.py`` lists them. The strategy owns the flat
parameter storage (through its placement), the optimizer over the master shards and the step.
The engine drives it through a small lifecycle and never asks which stage it is:

    pre_forward()                before the module's forward: the parameters must be usable
    begin_micro_step(boundary)   before backward: will this micro step end an accumulation?
    post_backward()              right after loss.backward() (no-op below stage 3)
    end_backward()               after loss.backward(): finish the communication of this step
    hold_reductions()            from now on backward leaves gradients on the rank (coalesce_grad_reduction)
    end_window()                 the script ended the window (unmanaged step(), a held block's end): reduce
    backward_pending             a backward ran whose end_backward has not (a script's loss.backward())
    step(loss_scale, clip)       at the boundary: unscale, clip, overflow check, update, publish
    zero_grad()                  forget accumulated gradients (the engine's, and ``engine.zero_grad()``)
    state_dict()/load_state_dict(sd)   the checkpoint format of the contract (all stages)
    offload_states()/reload_states()   states to host memory and back (``offload_states.StateOffload``)

The gradients belong to the strategy. ``master.grad`` points at them only while ``step`` runs, so a
client calling ``optimizer.zero_grad()`` (to None or in place) at any point cannot touch them: the
optimizer the user holds has nothing to clear between steps.

Gradient scaling follows DeepSpeed: gradients are summed across ranks and averaged (divided by
the world size); with ``prescale_gradients`` they are divided by ``gradient_predivide_factor``
before the reduction and multiplied by ``factor / world`` after. The post factor, the loss-scale
unscale and the clip coefficient are folded into ONE multiply of this rank's fp32 gradient shard.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dslaunch.runtime.zero import grad_norm
from dslaunch.runtime.zero.exchange import FlatAllReduce, GradientExchange, TreeAllReduce
from dslaunch.runtime.zero.gradients import GradientPath
from dslaunch.runtime.zero.offload_states import StateOffload
from dslaunch.runtime.zero.partition import FlatLayout
from dslaunch.runtime.zero.placement import Placement, gather_over_ranks, sum_over_ranks
from dslaunch.runtime.zero.reduce_part import ReducePart
from dslaunch.runtime.zero.specs import (
    CommSettings,
    FlatShards,
    GroupSpec,
    OptimizerFactory,
    ReduceGroup,
    StepResult,
)

__all__ = ["ZeroStrategy", "ReducePart", "ParamSlot"]


class ParamSlot(tuple):
    """(strategy weakref, group index, param index) of a trained parameter. A pickled parameter
    (``torch.save`` of the Parameter object keeps its attributes) loses it: it unpickles as None."""

    def __new__(cls, strategy: Any, group: int, index: int) -> ParamSlot:
        return super().__new__(cls, (strategy, group, index))

    def __reduce__(self) -> tuple:
        return type(None), ()


class ZeroStrategy(StateOffload):
    """A ZeRO stage: a placement and a gradient path, the optimizer over the master, the step.

    Subclasses (the stages) set ``stage``, ``placement_type`` and ``gradients_type`` and nothing else.

    Args:
        groups: the trainable param groups (``GroupSpec``), in optimizer group order.
        make_optimizer: builds the torch optimizer over ``[{"params": [master], **hparams}]``,
            given the ``FlatShards`` describing those master tensors.
        comm: communication settings.
        process_group: the data-parallel group (None: the default group).
        module: the model (stage 3 hooks it to gather its parameters; the others ignore it).
        model_parallel_group: the ranks holding the other parts of this replica (pipeline stages,
            tensor slices; None: none): the gradient norm, hence the overflow skip and the clip
            factor, is summed over them too, so every part of the model takes the same step.
        exchange: how gradient buckets are summed over the group (``exchange.py``; None: one flat
            all-reduce). One that needs each rank's whole local gradient (the 1-bit optimizers')
            keeps stage 0/1's full gradient buffer at stage 2 too.

    collective: construct on all ranks of the group.
    """

    stage: ClassVar[int]
    placement_type: ClassVar[type[Placement]]
    gradients_type: ClassVar[type[GradientPath]]

    def __init__(self, groups: list[GroupSpec], make_optimizer: OptimizerFactory, comm: CommSettings,
                 process_group: Any = None, module: torch.nn.Module | None = None,
                 model_parallel_group: Any = None, exchange: GradientExchange | None = None,
                 reduce_groups: Mapping[str, ReduceGroup] | None = None):
        self.pg = process_group
        self.exchange = exchange if exchange is not None else FlatAllReduce(process_group)
        mp_world = dist.get_world_size(model_parallel_group) if model_parallel_group is not None else 1
        self._model_parallel_sum = sum_over_ranks(mp_world, model_parallel_group)
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.comm = comm
        self.reduce_group_names = [spec.reduce_group for spec in groups]  # checkpoints record them
        self.parts = self._build_parts(groups, {"data": ReduceGroup(process_group), **(reduce_groups or {})})
        main = self.parts[0]  # the data group's (the first part): what a dense model has alone
        self.placement, self.gradients = main.placement, main.gradients
        self.groups: list[Any] = [None] * len(groups)
        for part in self.parts:
            for gi, g in zip(part.indices, part.placement.groups, strict=True):
                self.groups[gi] = g
        # Per group, the pieces of this rank's gradient shard that count in the global norm (None: all)
        self._norm_pieces = [g.layout.counted_pieces(spec.norm_skipped) for g, spec in zip(self.groups, groups,
                                                                                             strict=True)]
        self._norm_units = [grad_norm.units(g.layout, self._norm_pieces[gi], self._part_of(gi).gradients.norm_cuts(
            self._part_of(gi).indices.index(gi))) for gi, g in enumerate(self.groups)]
        self.publisher = self.placement.publisher  # None when replicated; tests watch its gathers
        # with overlap_param_gather a forward waits per module for the last publish (publisher.gate); the
        # parts whose publisher does not gate are waited for whole before the forward
        self._ungated = [part for part in self.parts if part.placement.publisher is None or module is None
                         or not part.placement.publisher.gate(module)]
        self.optimizer = make_optimizer([{**g.hparams, "params": [g.master]} for g in self.groups],
                                        self._flat_shards())
        self.optimizer._global_grad_norm = 0.0  # the last step's norm, where DeepSpeed's scripts read it
        # As DeepSpeed, whose ZeRO-1/2 and 16-bit optimizers always compute the global norm
        # (get_global_grad_norm); a plain fp32 stage 0 step skips that pass unless clipping needs it.
        self._always_norm = self.placement.always_norm or any(g.dtype != torch.float32 for g in self.groups)
        self.last_step: StepResult | None = None  # the last boundary step's (engine.optimizer.overflow)
        self.offload = None  # offload_optimizer: the update runs where the master is (host memory)
        if comm.offload_optimizer:
            from dslaunch.runtime.zero.offload.step import OffloadedStep

            self.offload = OffloadedStep(self.groups, self.optimizer, comm.offload_bucket_numel, comm.nvme,
                                         comm.offload_ratio)
        for gi, g in enumerate(self.groups):  # for safe_get_full_* (dslaunch.utils): param -> its slot
            for pi, p in enumerate(g.params):
                p._dsl_slot = ParamSlot(weakref.ref(self), gi, pi)

    def _build_parts(self, specs: list[GroupSpec], reduce_groups: Mapping[str, ReduceGroup]) -> list[ReducePart]:
        """One ``ReducePart`` per reduce group the specs name, the data group's first (built even
        without a group of its own: the engine's loop reads its gradient path)."""
        names = ["data", *dict.fromkeys(s.reduce_group for s in specs if s.reduce_group != "data")]
        parts = []
        for name in names:
            if name not in reduce_groups:
                raise ValueError(f"a param group reduces over {name!r}, which the strategy was not given "
                                 f"(given: {sorted(reduce_groups)})")
            indices = [i for i, spec in enumerate(specs) if spec.reduce_group == name]
            if name == "data" and not indices and len(names) > 1:
                continue
            expert_exchange = TreeAllReduce if self.comm.layout_invariant else FlatAllReduce
            exchange = self.exchange if name == "data" else expert_exchange(reduce_groups[name].process_group)
            if exchange.needs_local_gradients and name != "data":
                raise ValueError(f"the {self.exchange.name} gradient exchange (1-bit optimizers) runs over the "
                                 f"data-parallel group only; param group(s) {indices} reduce over {name!r}")
            parts.append(ReducePart(type(self), [specs[i] for i in indices], indices, self.comm,
                                    reduce_groups[name], exchange))
        return parts

    @property
    def partitioned(self) -> bool:
        """Ranks own disjoint shards of the master and optimizer state (each saves its own)."""
        return self.placement.partitioned

    def _flat_shards(self) -> FlatShards:
        layouts = [FlatLayout.of([math.prod(shape) for shape in g.layout.shapes], g.layout.start, g.layout.end)
                   for g in self.groups]
        gather = gather_over_ranks(self.world_size, self.pg) if self.placement.partitioned else None
        return FlatShards(layouts, self.placement.norm_all_reduce, [g.layout for g in self.groups], gather)

    def group_comm(self, gi: int) -> tuple[int, int, Any]:
        """(ranks, my index, process group) that group ``gi``'s state is sharded over."""
        part = self._part_of(gi)
        return part.world_size, part.rank, part.pg

    def _part_of(self, gi: int) -> ReducePart:
        return next(part for part in self.parts if gi in part.indices)

    @property
    def average_factor(self) -> float:
        """What the step multiplies the stored gradient (the sum over the ranks) by to average it,
        before the loss unscale and the clip."""
        return self.comm.post_factor(self.exchange.summed_ranks(self.world_size))

    def group_grad_sumsq(self, gi: int) -> torch.Tensor:
        """Group ``gi``'s squared gradient norm as stored (the sum over the ranks, loss scale
        included), each parameter's elements counted once, summed over every rank holding the
        group: its reduce group, spread group and the model-parallel group.

        collective: all ranks of those groups."""
        shard, part = self.grad_shard(gi), self._part_of(gi)
        sq = grad_norm.total([grad_norm.sumsq(shard[lo:hi]) for _, lo, hi in self._norm_units[gi]], shard.device)
        part.sum_norm(sq)
        if self._model_parallel_sum is not None:
            self._model_parallel_sum(sq)
        return sq

    def grad_shard(self, gi: int) -> torch.Tensor:
        """Group ``gi``'s gradient where the next step reads it (``GradientPath.shard``)."""
        part = self._part_of(gi)
        if self.offload is not None:  # a write to it would miss the copy read ahead
            self.offload.forget_prefetch()
        return part.gradients.shard(part.indices.index(gi))

    def unreduced_grad(self, gi: int) -> torch.Tensor | None:
        """Group ``gi``'s whole rank-local gradient while it is unreduced (``no_sync()``, before
        the boundary, stages 0-1); None once reduced or where only a shard is kept."""
        part = self._part_of(gi)
        return part.gradients.unreduced_gradient(part.indices.index(gi))

    def gradient_of(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s whole gradient of this window where the step reads it, once the backward's
        reductions are complete (stages 0/1: its piece of the whole-gradient buffer, fp32 where
        gradients are summed in fp32); None for a parameter this strategy does not train, or where
        only a shard of the gradient is kept."""
        slot = getattr(param, "_dsl_slot", None)
        if slot is None or slot[0]() is not self:
            return None
        part = self._part_of(slot[1])
        return part.gradients.param_gradient(part.indices.index(slot[1]), slot[2])

    def synchronize(self) -> None:
        """Wait for in-flight parameter gathers: call before anything reads the module weights."""
        for part in self.parts:
            part.placement.wait()

    # ----- lifecycle --------------------------------------------------------------------------
    def pre_forward(self) -> None:
        """Before the module's forward: make the parameters usable (stages 0-2: wait for the last
        publish, or let each module wait for its part where the publisher gates them; stage 3
        gathers what this rank holds only a shard of)."""
        self._require_weights("forward")
        for part in self._ungated:
            part.placement.wait()

    def begin_micro_step(self, boundary: bool, sync: bool = True) -> None:
        """Before backward: whether this micro step ends an accumulation, and whether it reduces.

        Raises:
            NoSyncError: ``sync=False`` (``no_sync()``) where gradients must be reduced every micro
                step (stages 2 and 3).
        """
        self._require_weights("forward")  # (the backward's gradients: in the hooks)
        for part in self.parts:
            part.gradients.begin_micro_step(boundary, sync)

    def release_gathered(self, persistent: bool = False) -> None:
        """Stage 3 releases the whole parameters it gathered (``persistent``: those too, as
        ``engine.empty_partition_cache``); below it nothing is gathered."""

    def post_backward(self) -> None:
        """Right after loss.backward(), before ``end_backward``: stage 3 releases what it gathered."""

    def end_backward(self) -> None:
        """After loss.backward(): complete this micro step's reductions (collective)."""
        for part in self.parts:
            part.gradients.end_backward()
        self._read_ahead()

    def hold_reductions(self) -> None:
        """Backward leaves every gradient on this rank until ``end_window`` (coalesce_grad_reduction)."""
        for part in self.parts:
            part.gradients.hold()

    def end_window(self, reduce: bool = True) -> None:
        """The script ended the accumulation window (an unmanaged ``step()``, the end of
        ``hold_reductions``): reduce, once, what the backwards left on this rank (collective: all
        ranks); ``reduce=False`` only stops holding."""
        for part in self.parts:
            part.gradients.end_window(reduce)
        self._read_ahead()

    def _read_ahead(self) -> None:
        if self.offload is not None and all(part.gradients.boundary_done for part in self.parts):
            self.offload.prefetch(self._shards())  # the first bucket's copy overlaps what precedes the step

    @property
    def backward_pending(self) -> bool:
        """Gradients of a backward whose ``end_backward`` has not run (a script's own
        ``loss.backward()``): the engine completes it before stepping."""
        return any(part.gradients.backward_pending for part in self.parts)

    def zero_grad(self) -> None:
        """Forget the accumulated gradients."""
        for part in self.parts:
            part.gradients.zero_grad()
        if self.offload is not None:
            self.offload.forget_prefetch()

    def step(self, loss_scale: float = 1.0, clip: float = 0.0, check_overflow: bool = False) -> StepResult:
        """Unscale and clip this rank's gradient shard, skip on overflow, else update and publish.

        The global gradient norm is computed where DeepSpeed computes it (stages 1/2, 16-bit
        models) and whenever clipping or the overflow check needs it; a non-finite norm skips the
        step only for those two. ``grad_norm`` is None when it was not computed.

        collective: call on all ranks at the accumulation boundary.
        """
        self._require("step")
        self.synchronize()  # a gated publish whose params no forward used: the update rewrites its source
        grads = self._shards()
        if self.offload is None:  # (offloaded: the update streams them to the host bucket by bucket)
            for g, grad in zip(self.groups, grads, strict=True):
                g.master.grad = grad
        try:
            result = self._update(grads, loss_scale, clip, check_overflow)
            self.last_step = result
            if result.grad_norm is not None:  # unscaled, before clipping (inf/nan on overflow), as DeepSpeed's
                self.optimizer._global_grad_norm = result.grad_norm
            return result
        finally:
            # Gradients are reachable from the optimizer only during the step (see the module doc).
            for g in self.groups:
                g.master.grad = None
            self.zero_grad()

    def _update(self, grads: list[torch.Tensor], loss_scale: float, clip: float,
                check_overflow: bool) -> StepResult:
        post = self.average_factor / loss_scale
        guard = clip > 0 or check_overflow
        with self.offload.begin() if self.offload is not None else contextlib.nullcontext():
            norm = self._global_norm(grads) * post if guard or self._always_norm else None
        if guard and not math.isfinite(norm):
            return StepResult(True, norm)
        factor = post
        if clip > 0 and norm > clip:
            factor *= clip / (norm + 1e-6)
        if self.offload is not None:
            self.offload.update(grads, factor, self._optimizer_step)
        else:
            self._optimizer_step(grads, factor)
            for g in self.groups:
                g.copy_master_to_model()
        for part in self.parts:
            part.placement.publish()
        return StepResult(False, norm)

    def _shards(self) -> list[torch.Tensor]:
        """Every group's reduced gradient shard (``GradientPath.shards``), in group order."""
        out: list[Any] = [None] * len(self.groups)
        for part in self.parts:
            for gi, t in zip(part.indices, part.gradients.shards(), strict=True):
                out[gi] = t
        return out

    def _optimizer_step(self, grads: list[torch.Tensor], factor: float) -> None:
        """optimizer.step() on gradients multiplied by ``factor``.

        torch's fused optimizers unscale inside their kernel (``grad_scale``, the GradScaler
        protocol): that saves a full read-modify-write pass over the gradients.
        """
        opt = self.optimizer
        if factor == 1.0:
            opt.step()
        elif getattr(opt, "_step_supports_amp_scaling", False):
            opt.grad_scale = torch.tensor(1.0 / factor, dtype=torch.float32, device=grads[0].device)
            try:
                opt.step()
            finally:
                del opt.grad_scale
        else:
            torch._foreach_mul_(grads, factor)
            opt.step()

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        """The norm of every distinct parameter's gradient, each counted once: per reduce group,
        this rank's shards (less the pieces another rank counts) summed over the ranks sharing the
        group's state, then over the ranks holding other parameters of it (expert groups: the
        other experts); then the groups' sum over the replica. A shard's sum is its units'
        (``grad_norm.py``), folded into the backward's writes where the gradient path took them.

        collective: all ranks of every reduce group (and spread group) and of the model-parallel group."""
        total = torch.zeros((), dtype=torch.float64, device=grads[0].device)  # CUDA scalars can't add to CPU
        # fp32 pieces' norms depend on where the layout cuts them; in float64 the sum is exact to
        # ~1e-16, so the fp32 clip factor comes out the same at any layout (but for a rounding tie)
        piece_dtype = torch.float64 if self.comm.layout_invariant else torch.float32
        for reduce_part in self.parts:
            sums: list[grad_norm.Sum] = []
            for gi in reduce_part.indices:
                folded = reduce_part.gradients.folded_sumsq(reduce_part.indices.index(gi))
                if (folded is not None and self._norm_pieces[gi] is None
                        and len(folded) == len(self._norm_units[gi])):  # taken as backward wrote them
                    sums += folded
                else:
                    sums += [grad_norm.sumsq(grads[gi][lo:hi], piece_dtype) for _, lo, hi in self._norm_units[gi]]
                    if self.offload is not None:
                        self.offload.clock.norm_bytes += sum(hi - lo for _, lo, hi in self._norm_units[gi]) * 4
            sq = grad_norm.total(sums, grads[0].device)
            reduce_part.sum_norm(sq)
            total += sq if reduce_part.norm_owner is not False else 0.0  # False: the owner adds this group
        if self._model_parallel_sum is not None:
            self._model_parallel_sum(total)
        return math.sqrt(total.item()) if math.isfinite(total.item()) else float("nan")

    def sync_master_from_model(self) -> None:
        """Copy this rank's slice of the module weights into the fp32 master (16-bit models), for
        ``engine.load_state_dict``: weights written from outside must survive the next step."""
        self._require("loading weights")
        self.synchronize()
        for g in self.groups:
            g.copy_model_to_master()

    def state_dict(self) -> dict:
        """This rank's shard of every group: master, optimizer state, hparams (live tensors)."""
        self._require("a checkpoint")
        self.synchronize()
        opt_sd = self.optimizer.state_dict()
        if self.offload is not None:  # NVMe: in the swap file; partial offload: in two parts
            for gi, tensors in self.offload.state_tensors().items():
                opt_sd["state"][gi] = {**opt_sd["state"].get(gi, {}), **tensors}
        out = []
        for gi, g in enumerate(self.groups):
            lay = g.layout
            state = opt_sd["state"].get(gi, {})
            tensors = {k: v for k, v in state.items()
                       if torch.is_tensor(v) and v.dim() > 0 and v.numel() == lay.end - lay.start}
            scalars = {k: v for k, v in state.items() if k not in tensors}
            hparams = {k: v for k, v in opt_sd["param_groups"][gi].items() if k != "params"}
            out.append({"names": list(lay.names), "shapes": list(lay.shapes), "numel": lay.numel,
                        "start": lay.start, "end": lay.end, "master": g.master.data,
                        "optim_state": tensors, "optim_scalars": scalars, "hparams": hparams,
                        **({} if self.reduce_group_names[gi] == "data" else {"reduce_group": self.reduce_group_names[gi]})})
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "groups": out}

    def load_state_dict(self, sd: dict) -> None:
        """Restore from groups whose [start, end) covers this rank's range; refresh the model.

        collective: call on all ranks (stages 1/2 re-gather the parameters).

        Raises:
            ValueError: the saved groups do not match this model (names, sizes or coverage).
        """
        self._require("loading a checkpoint")
        saved = sd["groups"]
        if len(saved) != len(self.groups):
            raise ValueError(f"checkpoint has {len(saved)} param groups, the optimizer has "
                             f"{len(self.groups)}")
        state: dict[int, dict] = {}
        groups = []
        full = True
        for gi, (g, s) in enumerate(zip(self.groups, saved, strict=True)):
            lay = g.layout
            if s["numel"] != lay.numel or list(s["names"]) != list(lay.names):
                raise ValueError(f"param group {gi}: checkpoint holds {s['numel']} elements of "
                                 f"{len(s['names'])} params, the model {lay.numel} of {len(lay.names)}")
            if not (s["start"] <= lay.start and lay.end <= s["end"]):
                raise ValueError(f"param group {gi}: checkpoint range [{s['start']}, {s['end']}) "
                                 f"does not cover this rank's [{lay.start}, {lay.end})")
            lo, hi = lay.start - s["start"], lay.end - s["start"]
            g.master.data.copy_(s["master"][lo:hi])
            state[gi] = {**{k: v[lo:hi].clone() for k, v in s["optim_state"].items()},
                         **s["optim_scalars"]}
            groups.append({**s["hparams"], "params": [gi]})
            full = full and s["start"] == 0 and s["end"] == lay.numel and g.load_full(s["master"])
        self.optimizer.load_state_dict({"state": {k: v for k, v in state.items() if v},
                                        "param_groups": groups})
        if self.offload is not None:
            self.offload.store_loaded()
        for g in self.groups:
            g.copy_master_to_model()
        if not full:
            for part in self.parts:
                part.placement.publish()
        self.zero_grad()

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds beyond the model weights, by purpose.

        ``optimizer_state``, ``master`` (fp32 copies of 16-bit weights), ``gradients`` (kept
        between micro steps) and ``comm_buffers``: reduction buffers (stage 2 buckets; stage 0/1
        only when the communication dtype differs from the gradients'), pooled or in flight, at
        most ``MAX_INFLIGHT_BUFFERS + open buckets`` of the largest bucket. The parameter gather
        broadcasts into the weights in place and holds no buffer.
        """
        opt = sum(t.numel() * t.element_size() for st in self.optimizer.state.values()
                  for t in st.values() if torch.is_tensor(t) and t.dim() > 0)  # not step counters
        master = sum(g.master.numel() * 4 for g in self.groups if g.dtype != torch.float32)
        if self.offload is not None and self.offload.split is not None:  # partial offload keeps its own
            opt += self.offload.split.state_bytes()
        return {"optimizer_state": opt, "master": master,
                "gradients": sum(part.gradients.held_bytes() for part in self.parts),
                "comm_buffers": sum(part.gradients.reducer.pool.held_bytes for part in self.parts)}
