"""``TrainingSetup``: the memory-relevant part of a ds_config, and the cluster, as one frozen record.

``TrainingSetup.from_ds_config`` reads a ds_config dict (leniently: the engine validates configs);
every field is checked when the record is made, so a bad value is one line naming the field.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from dslaunch.errors import UsageError
from dslaunch.runtime.config.sections import DTYPE_SPELLINGS

__all__ = ["TrainingSetup", "OPTIMIZER_STATE_BYTES", "PRECISIONS", "OFFLOAD_DEVICES", "MODEL_BYTES"]

Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "cpu", "nvme"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")

# Optimizer state bytes per fp32 master element (torch's layouts, which dslaunch keeps).
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "lamb": 8, "adagrad": 4, "lion": 4,
    "sgd_momentum": 4, "sgd": 0,
}
MODEL_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class TrainingSetup:
    """One training configuration to estimate: the ds_config's memory-relevant part and the cluster.

    Attributes:
        stage: ZeRO stage 0-3.
        precision: model (and gradient) dtype: ``fp32``, or ``bf16``/``fp16`` with fp32 masters.
        offload_optimizer: where the fp32 master and optimizer state live (stages 1-3).
        offload_param: where stage 3's parameter shards live (stage 3 only).
        optimizer: a key of ``OPTIMIZER_STATE_BYTES``.
        micro_batch: ``train_micro_batch_size_per_gpu``.
        seq_len: tokens per sample (activations need it; None: not estimated).
        activation_checkpointing: keep only each layer's input and recompute the layer in backward.
        flash_attention: attention that stores no seq x seq scores (torch SDPA, flash-attn).
        gpus_per_node, nodes: the cluster; world = their product.
        pipeline: pipeline-parallel degree (``PipelineModule(num_stages=...)``).
        tensor: tensor-parallel degree (AutoTP training, ``tensor_parallel.autotp_size``): each rank holds
            ``1/tensor`` of the sliced weights and activations.
        sequence: ranks that split each sequence (Ulysses, ``sequence_parallel_size``): each holds
            ``1/sequence`` of a sample's tokens; ZeRO partitions over data x sequence.
        expert_parallel: ranks an MoE layer's experts are spread over (``ep_size``; AutoEP's
            ``expert_parallel.autoep_size``): each holds ``1/expert_parallel`` of the experts, and
            ZeRO partitions those over the rest of data parallelism (the expert-data group).
        reduce_bucket_size: elements per reduce bucket (``zero_optimization.reduce_bucket_size``).
        overlap_comm: reductions in flight while backward runs (more buckets alive).
        param_persistence_threshold, max_live_parameters: stage 3's knobs (DeepSpeed's names).
        max_in_cpu: with ``offload_param: nvme``, shard elements kept in host memory.
        zero_init: stage 3 models built under ``zero.Init`` (each rank never holds the whole model);
            else every local rank materialises the whole model in host memory before ``initialize``.
        accelerator: ``cuda`` (a device apart from host memory) or ``cpu`` (ranks on CPU: an
            offloaded fp32 master is still the weights, and nothing is staged).
        shared_memory: ``shared_memory_collectives`` is not ``"never"``: on a CPU host
            (``accelerator: cpu``, one node) the engine keeps the buffers the data-parallel ranks
            read from each other in ``/dev/shm`` (``MemoryEstimate.shm``), not in private memory.
        sub_group_size: elements per offloaded-step bucket (pinned staging on a GPU host).
        nvme_buffer_count, nvme_buffer_size: ``offload_optimizer``'s NVMe ring in host memory.
        param_buffer_count, param_buffer_size: ``offload_param``'s NVMe staging pool (16-bit
            shards, or a GPU): at most that many buffers, never more than the file's chunks.
        grad_accum_fp32: a 16-bit model's gradients summed in fp32 (``data_types.grad_accum_dtype:
            "fp32"``): at stages 0/1 the whole gradient is fp32 (no separate fp32 copy of the rank's
            range), reduced through pooled copies in the model dtype.
        immediate_grad_update: ``bf16.immediate_grad_update``; false with ``grad_accum_fp32`` and
            bf16 at stages 0/1: every 16-bit gradient is alive at backward's end.
    """

    stage: int = 0
    precision: Precision = "fp32"
    offload_optimizer: Offload = "none"
    offload_param: Offload = "none"
    optimizer: str = "adamw"
    micro_batch: int = 1
    seq_len: int | None = None
    activation_checkpointing: bool = False
    flash_attention: bool = False
    gpus_per_node: int = 1
    nodes: int = 1
    pipeline: int = 1
    tensor: int = 1
    sequence: int = 1
    expert_parallel: int = 1
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_in_cpu: int = 1_000_000_000
    zero_init: bool = True
    accelerator: Literal["cuda", "cpu"] = "cuda"
    shared_memory: bool = True
    sub_group_size: int = 1_000_000_000
    nvme_buffer_count: int = 4
    nvme_buffer_size: int = 100_000_000
    param_buffer_count: int = 4
    param_buffer_size: int = 100_000_000
    grad_accum_fp32: bool = False
    immediate_grad_update: bool = False

    def __post_init__(self) -> None:
        checks = [
            (self.stage in (0, 1, 2, 3), "stage", "0, 1, 2 or 3"),
            (self.precision in PRECISIONS, "precision", " or ".join(PRECISIONS)),
            (self.offload_optimizer in OFFLOAD_DEVICES, "offload_optimizer", "none, cpu or nvme"),
            (self.offload_param in OFFLOAD_DEVICES, "offload_param", "none, cpu or nvme"),
            (self.offload_optimizer == "none" or self.stage >= 1, "offload_optimizer", "none below stage 1"),
            (self.offload_param == "none" or self.stage == 3, "offload_param", "none below stage 3"),
            (self.optimizer in OPTIMIZER_STATE_BYTES, "optimizer", ", ".join(OPTIMIZER_STATE_BYTES)),
            (self.seq_len is None or self.seq_len > 0, "seq_len", "a positive integer"),
            (self.accelerator in ("cuda", "cpu"), "accelerator", "cuda or cpu"),
        ]
        for f in fields(self):  # whole numbers where the field is one (a config may hold "4" or 4.5)
            value = getattr(self, f.name)
            if f.type in ("int", "int | None") and value is not None and (isinstance(value, bool) or not
                                                                         isinstance(value, int)):
                raise UsageError(f"{f.name}: got {value!r}; valid: an integer")
        for name in ("micro_batch", "gpus_per_node", "nodes", "pipeline", "tensor", "sequence", "expert_parallel",
                     "reduce_bucket_size",
                     "sub_group_size", "nvme_buffer_count", "nvme_buffer_size", "param_buffer_count",
                     "param_buffer_size"):
            checks.append((getattr(self, name) >= 1, name, "a positive integer"))
        for name in ("param_persistence_threshold", "max_live_parameters", "max_in_cpu"):
            checks.append((getattr(self, name) >= 0, name, "an integer >= 0"))
        for ok, name, valid in checks:
            if not ok:
                raise UsageError(f"{name}: got {getattr(self, name)!r}; valid: {valid}")
        if self.world % (self.pipeline * self.tensor * self.sequence):
            raise UsageError(f"pipeline * tensor * sequence = {self.pipeline * self.tensor * self.sequence} must "
                             f"divide the world size {self.world} (gpus_per_node x nodes)")
        if self.data_parallel % self.expert_parallel:
            raise UsageError(f"expert_parallel: got {self.expert_parallel}; valid: a divisor of the data-parallel "
                             f"size {self.data_parallel} (experts are spread over data-parallel ranks)")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def data_parallel(self) -> int:
        return self.world // (self.pipeline * self.tensor * self.sequence)

    @classmethod
    def from_ds_config(cls, config: Mapping[str, Any], **overrides: Any) -> TrainingSetup:
        """The setup a ds_config dict describes; ``overrides`` (any field) win over it.

        Reads, does not validate: unknown keys are ignored and ``"auto"`` keeps the default (the
        engine validates the config when it runs). Without ``train_micro_batch_size_per_gpu`` the
        micro batch is ``train_batch_size / (gradient_accumulation_steps x data parallel)``. Cluster fields (``gpus_per_node``, ``nodes``,
        ``seq_len``, ``pipeline``) come from ``overrides``. ``activation_checkpointing`` is on when
        the config has a non-empty ``activation_checkpointing`` section.

        Raises:
            UsageError: a value of the wrong kind, or the resulting setup is invalid.
        """
        zero = _section(config, "zero_optimization")
        opt = _section(zero, "offload_optimizer")
        par = _section(zero, "offload_param")
        precision = "bf16" if _section(config, "bf16").get("enabled") is True else \
            "fp16" if _section(config, "fp16").get("enabled") is True else "fp32"
        optimizer = str(_section(config, "optimizer").get("type", "adamw")).lower()
        if optimizer == "sgd" and _known(_section(_section(config, "optimizer"), "params").get("momentum")):
            optimizer = "sgd_momentum"
        read = {
            "stage": zero.get("stage"), "precision": precision,
            "offload_optimizer": opt.get("device"), "offload_param": par.get("device"),
            "optimizer": optimizer if optimizer in OPTIMIZER_STATE_BYTES else None,
            "micro_batch": config.get("train_micro_batch_size_per_gpu"),
            "sequence": config.get("sequence_parallel_size"),
            "tensor": _section(config, "tensor_parallel").get("autotp_size"),
            "expert_parallel": _autoep_size(config),
            "activation_checkpointing": bool(_section(config, "activation_checkpointing")) or None,
            "reduce_bucket_size": zero.get("reduce_bucket_size"), "overlap_comm": zero.get("overlap_comm"),
            "param_persistence_threshold": _stage3(zero, "param_persistence_threshold"),
            "max_live_parameters": _stage3(zero, "max_live_parameters"),
            "max_in_cpu": par.get("max_in_cpu"), "sub_group_size": zero.get("sub_group_size"),
            "shared_memory": _shared_memory(config.get("shared_memory_collectives")),
            "nvme_buffer_count": opt.get("buffer_count"), "nvme_buffer_size": opt.get("buffer_size"),
            "param_buffer_count": par.get("buffer_count"), "param_buffer_size": par.get("buffer_size"),
            "grad_accum_fp32": DTYPE_SPELLINGS.get(str(_section(config, "data_types").get("grad_accum_dtype"))) == "fp32",
            "immediate_grad_update": _section(config, "bf16").get("immediate_grad_update"),
        }
        if not _known(read["micro_batch"]):  # from the batch triad, as the engine derives it
            degrees = {k: read[k] for k in ("sequence", "tensor") if _known(read[k])}
            read["micro_batch"] = _micro_from_batch(config, {**degrees, **overrides})
        kinds = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, value in read.items():
            if not _known(value):
                continue
            if "int" in kinds[key] and not isinstance(value, bool) and isinstance(value, int | float):
                value = int(value)
            values[key] = value
        return cls(**{**values, **overrides})

    def with_(self, **changes: Any) -> TrainingSetup:
        """A copy with ``changes`` (validated again)."""
        return replace(self, **changes)


def _micro_from_batch(config: Mapping[str, Any], given: Mapping[str, Any]) -> int | None:
    """``train_batch_size / (gradient_accumulation_steps x data parallel)`` when both are given;
    ``given``: the world and the model-parallel degrees (the config's, the caller's overrides)."""
    total, accum = config.get("train_batch_size"), config.get("gradient_accumulation_steps", 1)
    if not (isinstance(total, int) and isinstance(accum, int)) or accum <= 0:
        return None
    world = given.get("gpus_per_node", 1) * given.get("nodes", 1)
    model_parallel = 1
    for axis in ("pipeline", "tensor", "sequence"):  # a bad value is the setup's own error later
        degree = given.get(axis, 1)
        model_parallel *= degree if isinstance(degree, int) and degree >= 1 else 1
    return max(1, total // (accum * (world // model_parallel or 1)))


def _shared_memory(setting: Any) -> bool | None:
    """``shared_memory_collectives``: off only for ``"never"``; None (the default, on) when unset."""
    return None if setting is None else setting != "never"


def _autoep_size(config: Mapping[str, Any]) -> Any:
    """AutoEP's expert-parallel size (``expert_parallel.autoep_size`` when ``enabled``), or None."""
    block = _section(config, "expert_parallel")
    return block.get("autoep_size") if block.get("enabled") is True else None


def _known(value: Any) -> bool:
    return value is not None and value != "auto"


def _section(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = config.get(key)
    if value is None or value is False:
        return {}
    if value is True:  # DeepSpeed's "zero_optimization": true (stage 1)
        return {"stage": 1} if key == "zero_optimization" else {"enabled": True}
    if not isinstance(value, Mapping):
        raise UsageError(f"ds_config '{key}': expected an object, got {type(value).__name__}")
    return value


def _stage3(zero: Mapping[str, Any], key: str) -> Any:
    return zero.get(f"stage3_{key}", zero.get(key))
