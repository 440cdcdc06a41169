"""``init_inference`` and ``InferenceEngine``: a model sharded over a tensor-parallel group.

The engine owns the order of things: parse the config, find the group, plan the sharding on the
model's dataflow (``auto_tp``), fill each rank's shards from the checkpoint or the model's own
weights (``loading``), and pick the all-reduce of the row-parallel layers (shared memory on one
host, else ``dslaunch.comm``). Each ``forward`` / ``generate`` first checks that every rank got
the same inputs (and, when sampling, the same random state): ranks that disagree would compute
different tokens, or wait on each other forever when their shapes differ.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dslaunch.errors import UsageError
from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import waiting
from dslaunch.runtime.inference.config import DeepSpeedInferenceConfig, device_notes, parse_inference_config
from dslaunch.runtime.inference.loading import ModuleSource, WeightSource, has_meta, open_checkpoint
from dslaunch.runtime.inference.shm_allreduce import ShmAllReduce, same_host
from dslaunch.runtime.parallel.dims import ParallelDims
from dslaunch.runtime.parallel.groups import ParallelGroups
from dslaunch.runtime.parallel.mpu import tensor_axis
from dslaunch.runtime.tensor_parallel.auto_tp import TPPlan, is_linear, plan_tensor_parallel
from dslaunch.runtime.tensor_parallel.collectives import (
    NO_COLLECTIVES,
    Collectives,
    inference_collectives,
    inputs_agree,
)
from dslaunch.runtime.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from dslaunch.runtime.tensor_parallel.shard import replace_module, set_local_attributes, shard_modules

__all__ = ["init_inference", "InferenceEngine"]

logger = logging.getLogger("dslaunch.inference")


def _tp_group(config: DeepSpeedInferenceConfig) -> Any:
    """The tensor-parallel group: given, from the mpu, the world, or the model axis of a topology."""
    tp = config.tensor_parallel
    if tp.tp_group is not None:
        return tp.tp_group
    if tp.mpu is not None:
        return tensor_axis(tp.mpu, "group")
    if tp.tp_size == 1:
        return None
    if not dist.is_initialized():
        comm.init_distributed()
    world = dist.get_world_size()
    dims = ParallelDims(tensor=tp.tp_size, keys=(("tensor", "tensor_parallel.tp_size"),))
    problem = dims.problem(world)
    if problem is not None:
        raise UsageError(problem)
    # the ranks that share each layer (the world itself when tp_size is the world)
    return ParallelGroups(dims.topology(world), dist.get_rank()).group("tensor")


def _shm_agrees(shm: ShmAllReduce, group: Any) -> bool:
    """One all-reduce of a rank-dependent tensor by both paths: the same sums (to rounding)."""
    rank = dist.get_rank(group)
    probe = torch.linspace(-1.0, 1.0, 4099) * (rank + 1) + rank
    expected = probe.clone()
    comm.all_reduce(expected, group=group)
    got = shm(probe.clone())
    agree = torch.tensor([float(torch.allclose(got, expected, rtol=1e-6, atol=1e-6))])
    comm.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
    return bool(agree.item())


def _collectives(group: Any, choice: str, device: torch.device) -> Collectives:
    """Shared memory when every rank of ``group`` is on this host (and agrees with gloo), else
    ``dslaunch.comm``.

    collective: every rank of ``group``.
    """
    if group is None:
        return NO_COLLECTIVES
    fallback = inference_collectives(group)
    if choice == "torch" or device.type != "cpu":
        return fallback
    if not same_host(group):
        if choice == "shm":
            raise UsageError("tp_allreduce='shm' needs every tensor-parallel rank on this host; use 'auto'")
        return fallback
    shm = ShmAllReduce(group)
    if not _shm_agrees(shm, group):
        logger.warning("dslaunch inference: the shared-memory all-reduce disagreed with gloo's; using gloo")
        return fallback

    def gather(local: torch.Tensor, widths: list[int]) -> torch.Tensor:
        # every rank decides alike: the shapes are the same on all of them
        if shm.fits_gather(local, widths):
            return shm.all_gather_last_dim(local, widths)
        return fallback.gather(local, widths)

    return Collectives(_seen_by_comm(shm, group), gather, "shared memory")


def _seen_by_comm(reduce: Callable[[torch.Tensor], torch.Tensor], group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The shm all-reduce as ``dslaunch.comm``'s own collectives are: marked as a wait on the peers
    (the monitor's hang blame) and timed by the comms logger as ``inference_all_reduce`` when on."""
    world, rank = dist.get_world_size(group), dist.get_rank()

    def call(t: torch.Tensor) -> torch.Tensor:
        with waiting("inference_all_reduce"):
            if not (comm.comms_logger.enabled and comm.comms_logger.wants("inference_all_reduce", False)):
                return reduce(t)
            start = time.perf_counter()
            out = reduce(t)
            comm.comms_logger.append("inference_all_reduce", "inference_all_reduce",
                                     (time.perf_counter() - start) * 1000.0, t.numel() * t.element_size(), world, rank)
            return out

    return call


def _quantize_rest(model: nn.Module, source: WeightSource, dtype: torch.dtype) -> None:
    """With ``quant``: the Linears kept whole become int8 too (tied ones, e.g. an lm_head that is the
    embedding, stay as they are)."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    for name, module in list(model.named_modules()):
        if is_linear(module) and counts.get(id(module.weight), 0) == 1:
            weight = source.read(f"{name}.weight")
            weight = weight if isinstance(module, nn.Linear) else weight.t().contiguous()
            bias = source.read(f"{name}.bias") if getattr(module, "bias", None) is not None else None
            replace_module(model, name, ColumnParallelLinear(weight, bias, True, dtype))


_SHARDED = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)


def _fill_rest(model: nn.Module, source: WeightSource, dtype: torch.dtype | None, from_checkpoint: bool) -> None:
    """Every parameter not sharded (and every buffer the checkpoint holds): read whole, once per
    tensor object (tied parameters stay tied), cast to ``dtype``."""
    made = {id(t) for m in model.modules() if isinstance(m, _SHARDED) for t in (*m.parameters(), *m.buffers())}
    places: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
    for mod_name, module in model.named_modules():
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for attr, t in table.items():
                if t is not None and id(t) not in made:  # shards were made from the source already
                    full = f"{mod_name}.{attr}" if mod_name else attr
                    places.setdefault(id(t), []).append((module, attr, full, kind))
    names = source.names()
    for group in places.values():
        module, attr, _, is_param = group[0]
        current = (module._parameters if is_param else module._buffers)[attr]
        found = next((full for _, _, full, _ in group if full in names), None)
        if found is None:
            if current.device.type == "meta":
                raise UsageError(f"checkpoint: no tensor for {group[0][2]!r} (the model has it; the checkpoint "
                                 f"({getattr(source, 'origin', 'weights')}) does not)")
            if dtype is None or not current.is_floating_point():
                continue
            value = current
        elif not from_checkpoint and current.device.type != "meta" and dtype in (None, current.dtype):
            continue  # the model's own tensor, already right
        else:
            value = source.read(found)
            if tuple(value.shape) != tuple(current.shape):
                raise UsageError(f"checkpoint: {found!r} has shape {tuple(value.shape)}, the model expects "
                                 f"{tuple(current.shape)}")
        if value.is_floating_point():  # the config's dtype, else the model's (a bf16 file into an fp32 model)
            value = value.to(dtype or current.dtype)
        new = nn.Parameter(value, requires_grad=False) if is_param else value
        for mod, a, _, p in group:
            (mod._parameters if p else mod._buffers)[a] = new


class InferenceEngine(nn.Module):
    """The model, sharded over the tensor-parallel group; call it as the model (DeepSpeed's
    ``InferenceEngine``). ``module`` is the (modified) model itself.

    collective: ``forward`` and ``generate`` on every rank of the group, with the same inputs.
    """

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig):
        super().__init__()
        self._config = config
        self.mp_group = _tp_group(config)
        self.tp_size = dist.get_world_size(self.mp_group) if self.mp_group is not None else 1
        self.tp_rank = dist.get_rank(self.mp_group) if self.mp_group is not None else 0
        self.mp_world_size = self.tp_size  # DeepSpeed's attribute name
        if self.mp_group is not None and self.tp_size != config.tensor_parallel.tp_size \
                and config.tensor_parallel.tp_size != 1:
            raise UsageError(f"tensor_parallel.tp_size={config.tensor_parallel.tp_size} but the given group has "
                             f"{self.tp_size} ranks")
        device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
        for note in device_notes(config, device.type == "cuda"):
            logger.warning("dslaunch inference: %s", note)
        self.plan = plan_tensor_parallel(model, self.tp_size, self.tp_rank, config.injection_policy) \
            if self.tp_size > 1 else TPPlan((), (), ())
        self._comms = _collectives(self.mp_group, config.tp_allreduce, device)
        self.allreduce_name = self._comms.name
        self._load(model, config)
        set_local_attributes(model, self.plan)
        if config.replace_with_kernel_inject and device.type == "cuda":
            from dslaunch.runtime.inference.kernel_inject import inject_kernels

            inject_kernels(model)
        self.module = model.eval()

    def _load(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        compute = config.dtype if config.dtype not in (None, torch.int8) else None
        quantize = config.quant.enabled or config.dtype == torch.int8
        if config.checkpoint is not None:
            source = open_checkpoint(config.checkpoint, config.base_dir)
        elif has_meta(model):
            raise UsageError("init_inference: the model has parameters on the meta device and no checkpoint was "
                             "given; pass checkpoint=<weights directory, file or description JSON>")
        else:
            source = ModuleSource(model)
        layer_dtype = compute or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        shard_modules(model, self.plan, source, layer_dtype, quantize, self._comms)
        if quantize:
            _quantize_rest(model, source, layer_dtype)
        _fill_rest(model, source, compute, config.checkpoint is not None)

    def _check_same_inputs(self, values: Any, with_rng: bool) -> None:
        if self.mp_group is None:
            return
        if not inputs_agree(values, self.mp_group, with_rng):
            what = "inputs or random state (sampling seed)" if with_rng else "inputs"
            raise UsageError(f"init_inference: the tensor-parallel ranks got different {what}; every rank of the "
                             "group must call with the same inputs (and seed, e.g. torch.manual_seed(s) on every rank)")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_same_inputs((args, kwargs), with_rng=False)
        return self.module(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The Hugging Face model's ``generate``; every rank must pass the same arguments and, when
        sampling, hold the same random state."""
        if not hasattr(self.module, "generate"):
            raise UsageError(f"{type(self.module).__name__} has no generate(); call the engine as the model")
        sampling = bool(kwargs.get("do_sample") or getattr(getattr(self.module, "generation_config", None),
                                                           "do_sample", False))
        self._check_same_inputs((args, kwargs), with_rng=sampling)
        return self.module.generate(*args, **kwargs)


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """Shard ``model`` over a tensor-parallel group for inference (DeepSpeed's ``init_inference``).

    Args:
        model: a ``torch.nn.Module`` (a Hugging Face model, or one with an ``injection_policy``),
            with real weights or built under ``dslaunch.inference.empty_init()`` (then
            ``checkpoint`` is required).
        config: a dict or ``DeepSpeedInferenceConfig``; keyword arguments are the same keys.

    Returns:
        An ``InferenceEngine``.

    Raises:
        ConfigError: a bad key or value (one line). UsageError, CheckpointError: a group, model or
            checkpoint that cannot be used.

    collective: every rank of the tensor-parallel group (it creates groups and the shared memory).
    """
    return InferenceEngine(model, parse_inference_config(config, **kwargs))
