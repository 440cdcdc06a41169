"""One ``Accelerator`` for CPU and CUDA with DeepSpeed's method names and results (DeepSpeed's
``deepspeed.accelerator``, which ``dslaunch.accelerator`` re-exports).

CUDA delegates to ``torch.cuda``. CPU follows DeepSpeed's CPU accelerator: memory queries are
the process RSS and its peak (psutil), ``current_device()`` is ``LOCAL_RANK``, streams, events
and graphs are None or no-ops, ``synchronize`` does nothing, the backend is gloo. Op builders
(DeepSpeed's JIT-compiled C++/CUDA ops) do not exist here: ``get_op_builder`` returns None.

``CPU_Accelerator`` and ``CUDA_Accelerator`` are DeepSpeed's class names for the two kinds;
``set_accelerator`` picks one for the process through ``$DS_ACCELERATOR`` (DeepSpeed's own
override), not a module-level object.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from dslaunch.errors import UsageError, quote

__all__ = ["Accelerator", "CPU_Accelerator", "CUDA_Accelerator", "get_accelerator", "set_accelerator",
           "is_current_accelerator_supported"]

ENV = "DS_ACCELERATOR"  # DeepSpeed's override of the detected accelerator
_KINDS = ("cpu", "cuda")


class Accelerator:
    """DeepSpeed's ``DeepSpeedAccelerator`` for ``kind`` ``"cpu"`` or ``"cuda"``."""

    def __init__(self, kind: str):
        self._name = kind
        self._cuda = kind == "cuda"
        self._compile_backend = "inductor"
        self._peak_rss = 0

    # ----- device -------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None or not self._cuda else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> Any:
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> Any:
        # DeepSpeed's CPU accelerator answers LOCAL_RANK (a string when set): kept for callers
        # that build "cpu:<n>" names from it.
        return torch.cuda.current_device() if self._cuda else os.environ.get("LOCAL_RANK", 0)

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        if self._cuda:
            return torch.cuda.device_count()
        return max(int(os.environ.get("LOCAL_SIZE", "0")), 1)

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ----- dtypes ---------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        if self._cuda:
            return True
        try:  # DeepSpeed's test: fp16 math on CPU needs oneDNN's fp16 support
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float, torch.bfloat16] if self.is_bf16_supported() else [torch.float]
        return dtypes + ([torch.float16] if self.is_fp16_supported() else [])

    def is_triton_supported(self) -> bool:
        return self._cuda and torch.cuda.get_device_capability()[0] >= 8

    # ----- RNG ------------------------------------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def manual_seed(self, seed: int) -> Any:
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ----- streams, events, graphs ----------------------------------------------------------
    @property
    def Stream(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self) -> Any:  # noqa: N802 (DeepSpeed's name)
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return torch.cuda.graph(graph, pool, stream) if self._cuda else contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        if self._cuda:
            graph.replay()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    # ----- memory ---------------------------------------------------------------------------
    def _rss(self) -> int:
        import psutil

        rss = psutil.Process().memory_info().rss
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def _reset_peak(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0
            self._rss()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._rss()
        return self._peak_rss

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_peak_memory_stats = _reset_peak
    reset_max_memory_allocated = _reset_peak
    reset_max_memory_cached = _reset_peak

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        import psutil

        return psutil.virtual_memory().available

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    # ----- tensor types ---------------------------------------------------------------------
    def _tensor_type(self, name: str) -> Any:
        return getattr(torch.cuda if self._cuda else torch, name)


    # ----- compile and ops ------------------------------------------------------------------
    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise UsageError(f"compile backend {quote(backend)} is not one torch knows: {', '.join(known)}")
        self._compile_backend = backend

    def op_builder_dir(self) -> str:
        return "dslaunch.ops"

    def get_op_builder(self, class_name: str) -> None:
        """None: dslaunch compiles no DeepSpeed ops (its kernels live in ``dslaunch.kernels``)."""
        return None

    def create_op_builder(self, op_name: str) -> None:
        return None

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict[str, str], local_accelerator_ids: list[int]) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []

    def amp(self) -> Any:
        return torch.amp


# DeepSpeed's tensor-type properties (``get_accelerator().FloatTensor``): torch.cuda's or torch's.
for _type in ("BFloat16Tensor", "ByteTensor", "DoubleTensor", "FloatTensor", "HalfTensor", "IntTensor",
              "LongTensor"):
    setattr(Accelerator, _type, property(lambda self, _t=_type: self._tensor_type(_t)))


@functools.cache
def get_accelerator() -> Accelerator:
    """The process's accelerator: ``$DS_ACCELERATOR`` if set, else CUDA with a GPU, else CPU.

    Raises:
        UsageError: ``DS_ACCELERATOR`` names a kind dslaunch does not drive (xpu, npu, hpu, mps...).
    """
    kind = os.environ.get(ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in _KINDS:
        raise UsageError(f"{ENV}={quote(kind)}: dslaunch drives only {' and '.join(_KINDS)}")
    return Accelerator(kind)


class CPU_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's ``deepspeed.accelerator.cpu_accelerator.CPU_Accelerator``."""

    def __init__(self) -> None:
        super().__init__("cpu")


class CUDA_Accelerator(Accelerator):  # noqa: N801 - DeepSpeed's class name
    """DeepSpeed's ``deepspeed.accelerator.cuda_accelerator.CUDA_Accelerator``."""

    def __init__(self) -> None:
        super().__init__("cuda")


def set_accelerator(accel_obj: Accelerator) -> None:
    """Make ``accel_obj``'s kind the process's accelerator, as DeepSpeed's (its tests and custom
    launchers call ``set_accelerator(CPU_Accelerator())``): every later ``get_accelerator()`` in
    this process answers it. It is recorded in ``$DS_ACCELERATOR``, DeepSpeed's override, so the
    processes this one starts inherit it too (DeepSpeed's module-level object is not inherited).

    Raises:
        UsageError: ``accel_obj`` is not one of dslaunch's accelerators (DeepSpeed accepts any
            ``DeepSpeedAccelerator``; dslaunch drives only CPU and CUDA).
    """
    if not isinstance(accel_obj, Accelerator):
        raise UsageError(f"set_accelerator({type(accel_obj).__name__}): dslaunch drives only its CPU and CUDA "
                         "accelerators; pass CPU_Accelerator() or CUDA_Accelerator(), or get_accelerator()'s")
    os.environ[ENV] = accel_obj._name
    get_accelerator.cache_clear()  # the next call reads the variable again


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in _KINDS
