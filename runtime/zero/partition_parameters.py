"""DeepSpeed's ZeRO-3 user API: ``zero.Init``, ``GatheredParameters``, external parameters.

Same names, signatures and behaviour as ``deepspeed.runtime.zero.partition_parameters``:

- ``Init``: modules constructed inside are partitioned as they are built (a module's own
  parameters when the ``__init__`` of the module that built it returns, or its own when nothing
  did; rank 0's values are broadcast first so every rank agrees), so a model larger than one
  rank's memory can be built: at most one module's subtree is whole at a time; ``Init(module=m)`` partitions a built module; ``enabled=False``
  does nothing.
- ``GatheredParameters(params, modifier_rank=None)``: the parameters are whole inside the block;
  with ``modifier_rank`` what that rank wrote is broadcast and stored in every shard on exit,
  otherwise changes are dropped. Parameters that are not partitioned pass through untouched.
- ``unwrap_model_for_generation(engine)``: a ``GatheredParameters`` over all of the engine's
  parameters, yielding the engine (generation gathers nothing per step); training goes on after it.
- ``register_external_parameter(module, param)``: ``module``'s forward also gathers ``param``
  (a parameter of another module it reads directly).
- Inside ``Init`` torch's tensor constructors (``torch.tensor``, ``empty``, ``zeros``, ``ones``,
  ``full``, ``arange``, ``eye``, ``randn``) make tensors on the rank's device unless given one, and
  floating-point ones in the Init's dtype, as DeepSpeed's. Each is built by
  ``zero_wrapper_for_fp_tensor_constructor`` from the ``_orig_torch_*`` function, both read when
  the outermost Init is entered: transformers replaces the first (``prevent_arange_dtype_change``)
  to leave ``_orig_torch_arange``'s dtype alone. Differs from DeepSpeed: an Init without a 16-bit
  dtype casts nothing (DeepSpeed's casts to fp32), and ``torch.Tensor(...)`` is left as it is.

collective: entering ``Init`` blocks, building modules inside them and ``GatheredParameters``
enter/exit run collectives: call them on all ranks.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.accelerator import get_accelerator  # noqa: F401 (DeepSpeed's module has it; transformers reads it)
from dslaunch.runtime.comm import comm
from dslaunch.runtime.dist import device_for, init_distributed, local_rank
from dslaunch.runtime.heartbeat import waiting
from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.fetcher import external_params
from dslaunch.runtime.zero.params import ZeroParamStatus
from dslaunch.runtime.zero.partition import partition_range

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "zero_wrapper_for_fp_tensor_constructor", "OnDevice",
           "MultipleAllGatherHandles", "partitioned_param_data_shape", "unwrap_model_for_generation"]

# The shape of a partitioned parameter's ``.data`` outside a gather (``params._placeholder``)
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several in-flight gathers waited on as one (DeepSpeed's; its ``wait`` passes
    ``handle_dependency`` on by keyword, whatever each handle's ``wait`` signature)."""

    def __init__(self, handles: list[Any]):
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)

# torch's constructors as they were before any Init, under DeepSpeed's names (transformers compares
# a constructor with ``_orig_torch_arange`` to tell arange apart)
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn
_CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype | None,
                                           target_device: torch.device | None) -> Callable:
    """``fn`` (a torch tensor constructor) as it runs inside ``Init`` (DeepSpeed's signature).

    The tensor is made on ``target_device`` unless the call names a device; a floating-point
    result is cast to ``target_fp_dtype`` in place (it stays a leaf). None leaves either alone.
    """
    def construct(*args: Any, **kwargs: Any) -> torch.Tensor:
        if target_device is not None and kwargs.get("device") is None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor
    construct._dsl_init = True
    return construct


def _wrap_constructors(dtype: torch.dtype | None, device: torch.device) -> dict[str, Callable]:
    """Put Init's constructors in torch; return what they replaced ({} when an Init's already are)."""
    if getattr(torch.empty, "_dsl_init", False):
        return {}
    replaced = {name: getattr(torch, name) for name in _CONSTRUCTORS}
    for name in _CONSTRUCTORS:
        # the module's names are read now: transformers swaps the wrapper around Init's entry
        setattr(torch, name, zero_wrapper_for_fp_tensor_constructor(globals()[f"_orig_torch_{name}"],
                                                                    target_fp_dtype=dtype, target_device=device))
    return replaced


def _module_classes() -> list[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        for sub in stack.pop().__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


def _config_dtype(config: Any) -> torch.dtype | None:
    """The 16-bit dtype a ds_config enables (None: fp32), as DeepSpeed's Init reads it."""
    if config is None:
        return None
    if isinstance(config, (str, Path)):
        from dslaunch.runtime.config.file import read_config_file

        config = read_config_file(Path(config)) if not str(config).lstrip().startswith("{") \
            else json.loads(str(config))
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(config.get(key), dict) and config[key].get("enabled"):
            return dtype
    return None


class Init:
    """Partition parameters as modules are built (a context manager), or those of ``module``.

    Args:
        module: an already built module to partition now (then no context is needed).
        data_parallel_group: the group to partition over (default: the default group).
        config_dict_or_path / config: a ds_config; its fp16/bf16 section sets the shards' dtype.
        enabled: False makes it a no-op.
        dtype: the shards' dtype (overrides the config's).
        remote_device: ``"cpu"`` keeps the shards in host memory; else they go to this rank's
            device (cuda:LOCAL_RANK with GPUs, else cpu), as DeepSpeed's.
        pin_memory, mem_efficient_linear, mpu, ...: accepted for compatibility.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, **kwargs: Any):
        self.enabled = enabled
        self.group = data_parallel_group
        if enabled and data_parallel_group is None:
            init_distributed(verbose=False)  # as DeepSpeed's Init: a no-op when already initialised
        self.device = device_for(local_rank())
        self.home = torch.device("cpu") if remote_device == "cpu" else self.device
        self.dtype = dtype or _config_dtype(config_dict_or_path if config_dict_or_path is not None else config)
        self._patched: list[tuple[type, Any]] = []
        self._constructors: dict[str, Callable] = {}
        self._built: list[list[torch.nn.Module]] = []
        self._subclass_hook = False
        if enabled and module is not None:
            for m in module.modules():
                self._partition(m)

    # ----- partitioning --------------------------------------------------------------------
    def _partition(self, module: torch.nn.Module) -> None:
        # A parameter on the meta device has no values yet (torch.nn.utils.skip_init builds there,
        # then calls to_empty): it is partitioned once it has them (_finish, or initialize).
        for p in module.parameters(recurse=False):
            if not zp.is_partitioned(p) and not p.is_meta:
                self._partition_param(p)

    def _partition_param(self, p: torch.nn.Parameter) -> None:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        # on the device the engine computes on (NCCL broadcasts device tensors only)
        full = p.data.to(self.device).contiguous().reshape(-1)
        if world > 1:  # every rank's shard must come from the same values
            src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
            with waiting("zero.Init (broadcast)"):
                comm.broadcast(full, src=src, group=self.group)
        start, end = partition_range(full.numel(), world, rank)
        shard = full[start:end].to(device=self.home, dtype=self.dtype or full.dtype, copy=True)
        p._dsl_users = 0
        flat = zp.FlatShard(shard, full.numel(), world, rank, self.group, device=self.device)
        zp.attach(p, flat, 0, p.shape, persist=False)
        p.data = torch.empty(0, dtype=shard.dtype, device=p.device)

    # ----- the context: every nn.Module's __init__ partitions its parameters when it returns ----
    def _wrap(self, init: Any) -> Any:
        def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            depth = module.__dict__.get("_dsl_init_depth", 0)
            module.__dict__["_dsl_init_depth"] = depth + 1
            if depth == 0:
                self._built.append([])  # modules built while this one's __init__ runs
            try:
                init(module, *args, **kwargs)
            finally:
                module.__dict__["_dsl_init_depth"] = depth
            if depth == 0:  # the object's outermost __init__ (a subclass's may set values first)
                self._finish(module, self._built.pop())
        wrapped._dsl_init = True
        wrapped.__wrapped__ = init
        return wrapped

    def _finish(self, module: torch.nn.Module, children: list[torch.nn.Module]) -> None:
        # A parent's __init__ may still initialise its children's parameters after building them
        # (nn.MultiheadAttention zeroes out_proj.bias): children are partitioned when it returns.
        for child in children:
            self._partition(child)
        if self._built:
            # children still on meta wait for the parent above (skip_init materialises this one
            # when its __init__ returns)
            self._built[-1].extend(c for c in children if _on_meta(c))
            self._built[-1].append(module)
        else:
            self._partition(module)

    def _patch(self, cls: type) -> None:
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_dsl_init", False):
            cls.__init__ = self._wrap(init)
            self._patched.append((cls, init))

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        for cls in _module_classes():
            self._patch(cls)
        # classes defined inside the block (nn.Module defines no __init_subclass__ of its own)
        patch = self._patch

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            patch(cls)
        if "__init_subclass__" not in torch.nn.Module.__dict__:
            torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
            self._subclass_hook = True
        self._constructors = _wrap_constructors(self.dtype, self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, init in reversed(self._patched):
            cls.__init__ = init
        self._patched.clear()
        for name, fn in self._constructors.items():
            setattr(torch, name, fn)
        self._constructors = {}
        if self._subclass_hook:
            del torch.nn.Module.__init_subclass__
            self._subclass_hook = False


class OnDevice:
    """Modules and tensors built inside are made on ``device`` with floating-point values in
    ``dtype`` (DeepSpeed's ``deepspeed.OnDevice``): ``with OnDevice(dtype=torch.bfloat16,
    device="meta"): model = MyModel()``. ``enabled=False`` makes it a no-op. Inside a ``zero.Init``
    the Init's constructors stay (it already places tensors)."""

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._constructors: dict[str, Callable] = {}

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._constructors = _wrap_constructors(self.dtype, self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._constructors.items():
            setattr(torch, name, fn)
        self._constructors = {}


class GatheredParameters(contextlib.AbstractContextManager):
    """Whole values of partitioned parameters inside the block (DeepSpeed's signature).

    Args:
        params: a parameter or an iterable of them (others than partitioned ones are ignored).
        modifier_rank: the rank whose changes are kept (broadcast and re-partitioned on exit);
            None drops changes.
        fwd_module: accepted for compatibility (DeepSpeed registers the params as external).
        enabled: False makes it a no-op.
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True):
        items = [params] if isinstance(params, torch.Tensor) else list(params) if params is not None else []
        self.params = [p for p in items if zp.is_partitioned(p)] if enabled else []
        self.modifier_rank = modifier_rank
        if fwd_module is not None:
            for p in self.params:
                register_external_parameter(fwd_module, p)

    def __enter__(self) -> GatheredParameters:
        zp.hold(self.params)
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if self.modifier_rank is not None and exc_type is None:
                zp.write_back(self.params, self.modifier_rank)
        finally:
            zp.unhold(self.params)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """``module``'s forward also gathers ``parameter`` (one it reads but does not own)."""
    external_params(module)[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo ``register_external_parameter``."""
    external_params(module).pop(id(parameter), None)


@contextlib.contextmanager
def unwrap_model_for_generation(model: Any) -> Any:
    """Every parameter of ``model`` (an engine or a module) whole inside the block, which yields
    ``model``: generation runs without a gather per module and step (DeepSpeed's helper for it).

    Changes to the weights inside are dropped, as with ``GatheredParameters``. The stage-3 hooks stay
    installed (DeepSpeed removes and re-adds its own): on parameters held whole they gather and release
    nothing. Below stage 3 it does nothing.

    collective: call on all ranks.
    """
    with GatheredParameters(model.parameters()):
        yield model


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters(recurse=False))
