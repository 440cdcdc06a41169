"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, answered with what dslaunch has.

DeepSpeed JIT-compiles its ops through builders (``FusedAdamBuilder().load()``); scripts and
test suites ask them whether an op can run here (``deepspeed.ops.__compatible_ops__[NAME]``).
dslaunch ships its ops prebuilt (``dslaunch.kernels``), so a builder here only answers: the four
optimizer ops dslaunch has on every device (``cpu_adam``, ``cpu_adagrad``, ``cpu_lion``,
``fused_adam``) and block-sparse attention (``sparse_attn``) are compatible; every other builder is DeepSpeed's "not implemented" builder on
this accelerator (its ``NAME`` is ``deepspeed_not_implemented``, as on DeepSpeed's CPU
accelerator), and ``load()`` names the feature and what to use instead. ``builder.py`` is
DeepSpeed's ``op_builder.builder`` path (``OpBuilder`` for a script's own ops, the torch version).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpBuilder", "NotImplementedBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder",
           "FusedAdamBuilder", "AsyncIOBuilder", "SparseAttnBuilder", "compatible_ops"]

_USE_INSTEAD = ("dslaunch has no JIT-built DeepSpeed ops: use the optimizer classes of deepspeed.ops.adam, "
                "deepspeed.ops.adagrad, deepspeed.ops.lion, or name the optimizer in the config")


class OpBuilder:
    """One op; ``NAME`` is DeepSpeed's key in ``__compatible_ops__``."""

    NAME = "deepspeed_not_implemented"
    available = False

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.available

    def load(self, verbose: bool = True) -> Any:
        raise RuntimeError(f"{type(self).__name__}.load(): {_USE_INSTEAD}")


class NotImplementedBuilder(OpBuilder):
    """Every DeepSpeed op dslaunch does not have (DeepSpeed's CPU accelerator answers the same)."""


class CPUAdamBuilder(OpBuilder):
    NAME, available = "cpu_adam", True


class CPUAdagradBuilder(OpBuilder):
    NAME, available = "cpu_adagrad", True


class CPULionBuilder(OpBuilder):
    NAME, available = "cpu_lion", True


class FusedAdamBuilder(OpBuilder):
    NAME, available = "fused_adam", True


class AsyncIOBuilder(OpBuilder):
    """DeepSpeed's native ``aio_handle`` (libaio): not here, so not compatible. dslaunch's NVMe
    offload (``offload_optimizer``/``offload_param`` with ``device: nvme``) needs no such op: its
    swap files are read and written with ``os.preadv``/``os.pwritev`` on a thread pool."""

    NAME = "async_io"


class SparseAttnBuilder(OpBuilder):
    """Block-sparse attention (``deepspeed.ops.sparse_attention``): compatible on every device, its
    ops are torch code (``dslaunch.kernels.block_sparse``); there is nothing to ``load()``."""

    NAME, available = "sparse_attn", True


_HAVE = (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, SparseAttnBuilder)


def compatible_ops() -> dict[str, bool]:
    """DeepSpeed's ``__compatible_ops__``: op name -> whether it runs here."""
    return {NotImplementedBuilder.NAME: False, AsyncIOBuilder.NAME: False, **{builder.NAME: True for builder in _HAVE}}


def __getattr__(name: str) -> type[OpBuilder]:
    # FusedLambBuilder, QuantizerBuilder, InferenceBuilder, ...: importable, not compatible
    if name.endswith("Builder"):
        return NotImplementedBuilder
    raise AttributeError(f"module 'deepspeed.ops.op_builder' has no attribute {name!r}")
