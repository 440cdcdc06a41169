"""A model cut into pipeline stages (DeepSpeed's ``deepspeed.runtime.pipe.module``, same names).

- ``LayerSpec(typename, *args, **kwargs)``: a layer described, not built; each rank builds only
  the specs of its own stage, so a model larger than one rank's memory can be described whole.
- ``TiedLayerSpec(key, typename, ..., forward_fn, tied_weight_attr)``: layers sharing one module
  (an embedding reused as the output projection); each stage holding the key builds it once, the
  copies start equal (broadcast from the lowest stage) and their gradients are summed over the
  stages holding them before every step (``PipelineModule.allreduce_tied_weight_gradients``).
- ``PipelineModule(layers, num_stages | topology, loss_fn, ...)``: partitions ``layers`` over the
  stages (``partition_method``: ``parameters``, ``uniform`` or ``type:<regex>``), builds this
  rank's part and runs it as ``forward``; activation checkpointing every
  ``activation_checkpoint_interval`` layers.

The partition is computed identically on every rank from the specs alone (parameter counts come
from building each spec on the ``meta`` device: no memory, no RNG draw).

collective: construct on every rank of the world (the grid's and the ties' groups are created).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dslaunch.errors import UsageError, quote
from dslaunch.runtime.activation_checkpointing import checkpointing
from dslaunch.runtime.parallel.dims import ParallelDims
from dslaunch.runtime.parallel.grid import PipelineParallelGrid
from dslaunch.runtime.parallel.groups import new_groups
from dslaunch.runtime.parallel.topology import ProcessTopology
from dslaunch.runtime.pipe.placement import Placement, RoundRobin
from dslaunch.runtime.zero.partition_parameters import register_external_parameter

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "partition_uniform", "partition_balanced"]


class LayerSpec:
    """``typename(*module_args, **module_kwargs)``, built only where it is needed (``build()``)."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        if not isinstance(typename, type) or not issubclass(typename, torch.nn.Module):
            raise UsageError(f"LayerSpec: typename must be a torch.nn.Module subclass, got {quote(typename)}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> torch.nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every layer with the same ``key``.

    ``forward_fn(module, inputs)`` replaces ``module(inputs)`` where given (e.g. the output
    projection through an embedding's weight); ``tied_weight_attr`` names the shared parameter(s)
    (a string or a list of attribute paths) whose gradients are summed across stages.
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
                 tied_weight_attr: str | Sequence[str] = "weight", **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


# ---- partitions: boundaries[s] .. boundaries[s + 1] are stage s's layers ----------------------------
def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """``num_parts + 1`` boundaries; every part gets ``num_items // num_parts`` items and the first
    ``num_items % num_parts`` parts one more (DeepSpeed's split)."""
    chunk, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + chunk + (1 if part < extra else 0))
    return bounds


def _parts_needed(weights: Sequence[int], bound: int) -> int:
    parts, load = 1, 0
    for w in weights:
        if load + w > bound:
            parts, load = parts + 1, 0
        load += w
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous parts whose heaviest part is as light as possible, none empty while items last.

    The smallest feasible bottleneck is found by bisection; then each part takes as many items as
    fit under it (keeping one item for every later part), so items of weight 0 stay with the part
    before them (a transformer block's trailing activation stays with its block). With no more
    items than parts each part takes one item and the last parts are empty, as DeepSpeed's
    ``partition_balanced`` answers (``PipelineModule`` refuses too few layers before it asks).
    """
    if len(weights) <= num_parts:
        return partition_uniform(len(weights), num_parts)
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _parts_needed(weights, mid) <= num_parts else (mid + 1, hi)
    bounds, n = [0], len(weights)
    for part in range(num_parts - 1):
        end, load = bounds[-1], 0
        while end < n - (num_parts - 1 - part) and (end == bounds[-1] or load + weights[end] <= lo):
            load += weights[end]
            end += 1
        bounds.append(end)
    bounds.append(n)
    return bounds


def _param_count(layer: Any) -> int:
    """Trainable elements of a layer; specs are built on the meta device (no memory, no RNG)."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if not isinstance(layer, torch.nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def _type_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return type(layer).__name__


def _partition(layers: Sequence[Any], num_stages: int, method: str) -> list[int]:
    key = method.lower()
    if len(layers) < num_stages:
        raise UsageError(f"PipelineModule: {len(layers)} layers cannot fill {num_stages} stages (each stage needs "
                         "at least one layer)")
    if key == "uniform":
        return partition_uniform(len(layers), num_stages)
    if key == "parameters":
        return partition_balanced([_param_count(layer) for layer in layers], num_stages)
    if key.startswith("type:"):
        try:
            pattern = re.compile(method[5:], re.IGNORECASE)
        except re.error as err:
            raise UsageError(f"PipelineModule: partition_method {quote(method)} is not a valid regular "
                             f"expression ({err})") from None
        weights = [1 if pattern.search(_type_name(layer)) else 0 for layer in layers]
        if not any(weights):
            raise UsageError(f"PipelineModule: partition_method {quote(method)} matches no layer type "
                             f"(types: {sorted({_type_name(layer) for layer in layers})})")
        return partition_balanced(weights, num_stages)
    raise UsageError(f"PipelineModule: partition_method {quote(method)} is not one of 'parameters', 'uniform', "
                     "'type:<regex>'")


class PipelineModule(torch.nn.Module):
    """The layers of one pipeline stage, out of a sequence that describes the whole model.

    Args:
        layers: ``LayerSpec``/``TiedLayerSpec``, built ``nn.Module`` instances or plain callables,
            run in sequence; each layer takes the previous one's output as one argument (a tuple
            stays one argument).
        num_stages: pipeline stages (the data-parallel size is world / stages); or ``topology``.
        topology: a ``ProcessTopology`` with a ``pipe`` axis (``PipeDataParallelTopology``).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage (None: the output is the loss).
        seed_layers / seed_fn / base_seed: seed ``seed_fn(base_seed + layer index)`` before
            building each layer, so a layer's weights do not depend on which stage builds it.
        partition_method: ``parameters`` (balance trainable elements), ``uniform`` (balance layer
            counts) or ``type:<regex>`` (balance layers whose class name matches, case-insensitive).
        activation_checkpoint_interval: run every that many layers under
            ``activation_checkpoint_func`` (0: no checkpointing); only chunks with parameters, or
            with a layer whose class name is in ``checkpointable_layers`` where given.
        activation_checkpoint_func: as DeepSpeed's default, ``deepspeed.checkpointing.checkpoint``
            (the ds_config's ``activation_checkpointing`` block applies to it; the config's
            ``pipeline.use_reentrant: false`` swaps in ``non_reentrant_checkpoint``).
        dynamic_shape: DeepSpeed's switch for activations whose shape changes between micro
            batches; accepted and unneeded: every message carries its shapes (``p2p.py``).
        virtual_stages: (dslaunch) cut the layers into ``num_stages * virtual_stages`` parts;
            rank ``s`` holds parts ``s, s + num_stages, ...`` (its chunks), for the interleaved
            schedule (``pipeline.schedule: "interleaved"``). 1: one contiguous part per stage.

    Raises:
        UsageError: no stages or topology, stages that do not divide the world, fewer layers than
            stages, an unknown partition method, a layer that is neither spec, module nor callable.

    collective: construct on every rank, with the same arguments.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 topology: ProcessTopology | None = None, loss_fn: Callable | None = None,
                 seed_layers: bool = False, seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable | None = None,
                 checkpointable_layers: Sequence[str] | None = None, dynamic_shape: bool = False,
                 virtual_stages: int = 1):
        super().__init__()
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not (isinstance(layer, LayerSpec | torch.nn.Module) or callable(layer)):
                raise UsageError(f"PipelineModule: layer {i} is {quote(layer)}; give a LayerSpec, TiedLayerSpec, "
                                 "torch.nn.Module or callable")
        if int(virtual_stages) < 1:
            raise UsageError(f"PipelineModule: virtual_stages must be >= 1, got {virtual_stages}")
        self._topo = _topology(num_stages, topology)
        self._grid = PipelineParallelGrid(self._topo)
        self.num_stages = self._topo.get_dim("pipe")
        self.stage_id = self._grid.get_stage_id()
        self.global_rank = self._grid.get_global_rank()
        self.loss_fn, self.partition_method = loss_fn, partition_method
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn or torch.manual_seed, base_seed
        self.activation_checkpoint_func = activation_checkpoint_func or checkpointing.checkpoint
        self.checkpointable_layers = list(checkpointable_layers) if checkpointable_layers else None
        self.dynamic_shape = bool(dynamic_shape)
        self._layer_specs = layers
        self.virtual_stages = int(virtual_stages)
        self.placement = self._placement()
        self.parts = _partition(layers, self.placement.num_parts, partition_method)
        self.tied_modules = torch.nn.ModuleDict()
        self.chunk_funcs: list[list[Callable]] = [self._build(self.placement.part(self.stage_id, c))
                                                  for c in range(self.placement.chunks)]
        self.forward_funcs = [f for funcs in self.chunk_funcs for f in funcs]
        self.tied_comms = self._tie_groups()
        self._synchronize_tied_weights()
        # A tied layer's forward_fn reads the module's weights without calling the module, so the
        # module's forward hooks (where ZeRO's overlapped publishing of updated weights is waited
        # for) never fire there: the pipeline module's own forward declares it uses them.
        for f in self.forward_funcs:
            if isinstance(f, _TiedCall) and f.forward_fn is not None:
                for p in f.module.parameters():
                    register_external_parameter(self, p)
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)

    def _placement(self) -> Placement:
        """Which parts each rank holds: round-robin, one per virtual stage."""
        return RoundRobin(self.num_stages, self.virtual_stages)

    @property
    def activation_checkpoint_interval(self) -> int:
        return self._checkpoint_interval

    @activation_checkpoint_interval.setter
    def activation_checkpoint_interval(self, interval: int) -> None:
        self.set_checkpoint_interval(interval)

    def set_checkpoint_interval(self, interval: int) -> None:
        """Checkpoint every ``interval`` layers from now on (0: off); which chunks qualify is
        worked out again for the new interval."""
        if int(interval) < 0:
            raise UsageError(f"PipelineModule: activation_checkpoint_interval must be >= 0 (0: no checkpointing), "
                             f"got {interval}")
        self._checkpoint_interval = int(interval)
        self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self) -> None:
        """Per chunk, whether each run of ``interval`` layers is checkpointed (DeepSpeed's
        ``is_checkpointable_results`` is the first chunk's)."""
        interval = self._checkpoint_interval
        self._checkpointable = [[self._is_checkpointable(funcs[i:i + interval]) for i in range(0, len(funcs), interval)]
                                if interval else [] for funcs in self.chunk_funcs]

    @property
    def is_checkpointable_results(self) -> list[bool]:
        """DeepSpeed's name for the first chunk's checkpointed runs of layers."""
        return self._checkpointable[0]

    # ----- building ---------------------------------------------------------------------------
    def _build(self, part: int) -> list[Callable]:
        """Build one part's layers; modules are registered under their global layer index."""
        funcs: list[Callable] = []
        for idx in range(self.parts[part], self.parts[part + 1]):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                self.seed_fn(self.base_seed + idx)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                funcs.append(_TiedCall(self.tied_modules[layer.key], layer.forward_fn))
            elif isinstance(layer, LayerSpec):
                module = layer.build()
                self.add_module(str(idx), module)
                funcs.append(module)
            elif isinstance(layer, torch.nn.Module):
                self.add_module(str(idx), layer)
                funcs.append(layer)
            else:
                funcs.append(layer)
        return funcs

    def _tie_groups(self) -> dict[str, dict[str, Any]]:
        """For each tie key held by more than one stage: the group of those stages in my replica.

        Every rank creates every group (collective over the world), in key order.
        """
        stages: dict[str, list[int]] = {}
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, TiedLayerSpec):
                stage = self.stage_owner(idx)
                if stage not in stages.setdefault(layer.key, []):
                    stages[layer.key].append(stage)
        comms: dict[str, dict[str, Any]] = {}
        data = self._topo.get_dim("data") or 1
        for key in sorted(stages):
            if len(stages[key]) < 2:
                continue
            lists = [[self._grid.stage_to_global(s, data=d) for s in stages[key]] for d in range(data)]
            group, ranks = new_groups(lists, self.global_rank)
            if group is not None:
                spec = next(x for x in self._layer_specs if isinstance(x, TiedLayerSpec) and x.key == key)
                comms[key] = {"ranks": ranks, "group": group, "weight_attr": spec.tied_weight_attr}
        for key, tie in comms.items():
            # the summed gradient counts once in the global norm: on the tie's lowest rank
            # (DeepSpeed's attribute, which the ZeRO param groups read)
            for weight in self._tied_weights_of(key, tie):
                weight.ds_pipe_replicated = self.global_rank != min(tie["ranks"])
        return comms

    def _tied_weights(self, key: str) -> list[torch.nn.Parameter]:
        return self._tied_weights_of(key, self.tied_comms[key])

    def _tied_weights_of(self, key: str, tie: dict[str, Any]) -> list[torch.nn.Parameter]:
        module = self.tied_modules[key]
        weights = []
        for path in tie["weight_attr"]:
            obj = module
            for part in path.split("."):
                obj = getattr(obj, part)
            weights.append(obj)
        return weights

    def _synchronize_tied_weights(self) -> None:
        """Every copy of a tied module starts as the lowest stage's (collective over the tie)."""
        from dslaunch.runtime.comm import comm

        for key, tie in self.tied_comms.items():
            for weight in self._tied_weights(key):
                comm.broadcast(weight.data, src=min(tie["ranks"]), group=tie["group"])

    def allreduce_tied_weight_gradients(self, gradient_of: Callable[[torch.nn.Parameter], torch.Tensor | None]
                                        | None = None) -> None:
        """Sum each tied weight's gradient over the stages holding it (collective over each tie).

        Call after every backward of the step has accumulated into ``.grad``. ``gradient_of(weight)``
        (dslaunch's; the engine passes its ZeRO strategy's) names where the step reads the
        gradient when that is not ``.grad`` (fp32 sums of a 16-bit model); None: ``.grad``.
        """
        from dslaunch.runtime.comm import comm

        for key, tie in self.tied_comms.items():
            for weight in self._tied_weights(key):
                grad = gradient_of(weight) if gradient_of is not None else None
                if grad is None:
                    if weight.grad is None:
                        weight.grad = torch.zeros_like(weight)
                    grad = weight.grad
                comm.all_reduce(grad, group=tie["group"])

    # ----- running ----------------------------------------------------------------------------
    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        """Run this rank's layers (of ``chunk``, with virtual stages) on ``inputs``."""
        layers = self.chunk_funcs[chunk]
        interval = self._checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return _run(layers, inputs)
        x = inputs
        for start, checkpointed in zip(range(0, len(layers), interval), self._checkpointable[chunk], strict=True):
            funcs = layers[start:start + interval]
            if checkpointed:
                args = x if isinstance(x, tuple) else (x,)
                x = self.activation_checkpoint_func(_chunk(funcs), *args)
            else:
                x = _run(funcs, x)
        return x

    def _is_checkpointable(self, funcs: Sequence[Callable]) -> bool:
        if self.checkpointable_layers is not None:
            return any(type(_module_of(f)).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in m.parameters()) for f in funcs if (m := _module_of(f)) is not None)

    # ----- DeepSpeed's accessors ----------------------------------------------------------------
    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def topology(self) -> ProcessTopology:
        return self._topo

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < len(self._layer_specs):
            raise UsageError(f"stage_owner: layer {layer_idx} is outside 0..{len(self._layer_specs) - 1}")
        part = next(p for p in range(len(self.parts) - 1) if self.parts[p] <= layer_idx < self.parts[p + 1])
        return self.placement.owner(part)[0]

    @property
    def num_layers(self) -> int:
        """Layers of the whole model (all stages)."""
        return len(self._layer_specs)

    def checkpoint_layers(self) -> dict[int, str]:
        """This rank's module layers: global layer index -> the prefix of its keys in
        ``state_dict()`` (``"3."``; ``"tied_modules.<key>."`` for a tied layer). Checkpoints keep one
        file per entry (DeepSpeed's ``layer_XX-model_states``), so another pipeline shape finds
        each layer by its index."""
        out: dict[int, str] = {}
        for chunk in range(self.placement.chunks):
            part = self.placement.part(self.stage_id, chunk)
            for idx in range(self.parts[part], self.parts[part + 1]):
                layer = self._layer_specs[idx]
                if isinstance(layer, TiedLayerSpec):
                    out[idx] = f"tied_modules.{layer.key}."
                elif isinstance(layer, LayerSpec | torch.nn.Module):
                    out[idx] = f"{idx}."
        return out

    def get_tied_weights_and_groups(self) -> list[tuple[torch.nn.Parameter, Any]]:
        return [(w, comm["group"]) for key, comm in self.tied_comms.items() for w in self._tied_weights(key)]


def _topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    import torch.distributed as dist

    if topology is not None:
        if "pipe" not in topology.get_axis_names():
            raise UsageError(f"PipelineModule: topology {topology.shape()} has no 'pipe' axis")
        return topology
    if num_stages is None:
        raise UsageError("PipelineModule: give num_stages=<int> or topology=<ProcessTopology>")
    if not dist.is_initialized():
        raise UsageError("PipelineModule needs torch.distributed: call deepspeed.init_distributed() first")
    world = dist.get_world_size()
    dims = ParallelDims(pipe=num_stages, keys=(("pipe", "num_stages"),))
    problem = dims.problem(world)
    if problem is not None:
        raise UsageError(f"PipelineModule: {problem}")
    return dims.topology(world)


class _TiedCall:
    """A tied layer's call: ``forward_fn(module, x)`` or ``module(x)``."""

    def __init__(self, module: torch.nn.Module, forward_fn: Callable | None):
        self.module, self.forward_fn = module, forward_fn

    def __call__(self, x: Any) -> Any:
        return self.forward_fn(self.module, x) if self.forward_fn is not None else self.module(x)


def _module_of(func: Callable) -> torch.nn.Module | None:
    if isinstance(func, torch.nn.Module):
        return func
    return func.module if isinstance(func, _TiedCall) else None


def _run(funcs: Sequence[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _chunk(funcs: Sequence[Callable]) -> Callable:
    """The chunk as a function of unpacked tensors (what checkpoint functions call)."""

    def run(*args: Any) -> Any:
        return _run(funcs, args[0] if len(args) == 1 else args)

    return run
