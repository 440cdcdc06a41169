"""The search space: every ds_config the tuner may try, as ``Candidate`` records.

A candidate is a point on a few axes: ZeRO stage, offload (none, the optimizer state, or the
optimizer state and the parameters: stage 3 only), activation checkpointing (the
``activation_checkpointing`` block present or not: a script checkpoints when
``deepspeed.checkpointing.is_configured()``), micro batch, gradient accumulation and, when
``fast`` is off, the reduce bucket size and ``overlap_comm``. ``apply`` turns one into the
experiment's ds_config: the user's config with the candidate's keys set.

``dominates(a, b)``: ``b`` needs at least as much memory as ``a`` (larger micro batch, lower
stage, less offload, the same checkpointing); the search skips such ``b`` after ``a`` ran out of
memory.
Pure functions.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.runtime.config.autotuning import AutotuningConfig

__all__ = ["Candidate", "OFFLOADS", "build_space", "apply", "dominates", "micro_batches"]

OFFLOADS = ("none", "optimizer", "all")
"""Offload choices, from the most device memory to the least."""

_BUCKETS = (50_000_000, 500_000_000)  # DeepSpeed's tuning space has 5e7 and 5e8 (and 1e9)


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    stage: int
    offload: str | None
    """One of ``OFFLOADS``, or None: as the user's config (offload not tuned)."""
    checkpointing: bool | None
    """None: as the user's config (checkpointing not tuned)."""
    micro_batch: int
    gas: int
    reduce_bucket_size: int | None = None
    """None: the user's config decides."""
    overlap_comm: bool | None = None

    @property
    def name(self) -> str:
        """A short name for tables and directories: ``z2_off-optimizer_ckpt_mb8_gas1``."""
        parts = [f"z{self.stage}", f"off-{self.offload}" if self.offload not in ("none", None) else "",
                 "ckpt" if self.checkpointing else "", f"mb{self.micro_batch}", f"gas{self.gas}",
                 f"rb{self.reduce_bucket_size:.0e}".replace("+", "") if self.reduce_bucket_size else "",
                 {True: "overlap", False: "no-overlap", None: ""}[self.overlap_comm]]
        return "_".join(p for p in parts if p)


def micro_batches(at: AutotuningConfig, dp_world: int, gas: int) -> list[int]:
    """Up to ``num_tuning_micro_batch_sizes`` micro batches, powers of two from the largest allowed
    (by ``max_train_micro_batch_size_per_gpu`` and ``max_train_batch_size``) down, largest first."""
    high = at.max_train_micro_batch_size_per_gpu
    if at.max_train_batch_size is not None:
        high = min(high, at.max_train_batch_size // (dp_world * gas))
    low = max(at.min_train_micro_batch_size_per_gpu, -(-at.min_train_batch_size // (dp_world * gas)))
    out: list[int] = []
    mb = 1 << (high.bit_length() - 1) if high >= 1 else 0
    while mb >= low and len(out) < at.num_tuning_micro_batch_sizes:
        out.append(mb)
        mb //= 2
    return sorted(out)


def _offloads(stage: int, at: AutotuningConfig) -> tuple[str | None, ...]:
    if not at.offload:
        return (None,)
    if stage == 0:  # stage 0 keeps the optimizer on every rank's device
        return ("none",)
    return OFFLOADS if stage == 3 else OFFLOADS[:2]  # parameters are offloaded at stage 3 only


def build_space(at: AutotuningConfig, dp_world: int, base_gas: int, stages: tuple[int, ...] = (0, 1, 2, 3)
                ) -> list[Candidate]:
    """Every candidate, in grid order (stage, offload, checkpointing, micro batch, ...).

    ``base_gas``: the user's ``gradient_accumulation_steps`` (1 if unset); with ``fast`` off,
    2x and 4x of it are tried too.
    """
    gases = (base_gas,) if at.fast else (base_gas, 2 * base_gas, 4 * base_gas)
    buckets: tuple[int | None, ...] = (None,) if at.fast else _BUCKETS
    overlaps: tuple[bool | None, ...] = (None,) if at.fast else (False, True)
    ckpts: tuple[bool | None, ...] = (False, True) if at.activation_checkpointing else (None,)
    out: list[Candidate] = []
    for stage in stages:
        for offload, ckpt, gas in itertools.product(_offloads(stage, at), ckpts, gases):
            for mb, bucket, overlap in itertools.product(micro_batches(at, dp_world, gas), buckets, overlaps):
                out.append(Candidate(stage, offload, ckpt, mb, gas, bucket if stage else None,
                                     overlap if stage else None))
    return list(dict.fromkeys(out))  # stage 0 has no buckets: drop the repeats


def apply(base: Mapping[str, Any], c: Candidate, world: int) -> dict[str, Any]:
    """The experiment's ds_config: ``base`` with ``c``'s keys (``world``: data-parallel ranks)."""
    cfg = copy.deepcopy(dict(base))
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        cfg.pop(key, None)
    cfg.update(train_micro_batch_size_per_gpu=c.micro_batch, gradient_accumulation_steps=c.gas,
               train_batch_size=c.micro_batch * c.gas * world)
    zero = dict(cfg.get("zero_optimization") or {})
    zero["stage"] = c.stage
    for key in ("offload_optimizer", "offload_param"):
        if c.offload is not None:
            zero.pop(key, None)
    if c.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if c.offload == "all":
        zero["offload_param"] = {"device": "cpu"}
    if c.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = c.reduce_bucket_size
    if c.overlap_comm is not None:
        zero["overlap_comm"] = c.overlap_comm
    cfg["zero_optimization"] = zero
    if c.checkpointing:
        cfg.setdefault("activation_checkpointing", {})
    elif c.checkpointing is False:
        cfg.pop("activation_checkpointing", None)
    return cfg


def dominates(a: Candidate, b: Candidate) -> bool:
    """Whether ``b`` needs at least the memory ``a`` needs (so ``b`` fails where ``a`` ran out)."""
    # Checkpointing is no axis of this order: it saves activations but holds the recompute's and
    # the saved inputs' copies, and on a small model it measured more memory, not less.
    return (b.micro_batch >= a.micro_batch and b.stage <= a.stage and _rank(b.offload) <= _rank(a.offload)
            and b.checkpointing == a.checkpointing)


def _rank(offload: str | None) -> int:
    return OFFLOADS.index(offload or "none")


def axes(c: Candidate) -> Iterator[tuple[str, Any]]:
    """The candidate's value on each axis (the model-based tuner's features)."""
    yield "stage", c.stage
    yield "offload", c.offload
    yield "checkpointing", c.checkpointing
    yield "micro_batch", c.micro_batch
    yield "gas", c.gas
    yield "reduce_bucket_size", c.reduce_bucket_size
    yield "overlap_comm", c.overlap_comm
