"""Bytes a training job holds per device and per host: ``estimate_memory(shape, setup)``.

The model is dslaunch's engine as built (``runtime/zero/``), not a rule of thumb:

- weights: the flat buffer in the model dtype, whole below stage 3, this rank's shard at stage 3
  (in host memory with ``offload_param: cpu``, on disk with ``nvme`` beyond ``max_in_cpu``);
- gradients: stages 0/1 keep the whole gradient in the model dtype (plus an fp32 copy of the rank's
  range for 16-bit models); stages 2/3 keep only the rank's fp32 shard;
- master: an fp32 copy of the rank's range for 16-bit models (an fp32 model's master *is* its
  weights), in host memory with ``offload_optimizer``;
- optimizer state: per master element (Adam 8 bytes), on the rank's range from stage 1, in host
  memory with ``offload_optimizer: cpu``, on disk with ``nvme``;
- communication buffers: stage 2/3 reduce buckets (staging in the model dtype, up to
  ``MAX_INFLIGHT_BUFFERS + 1`` with ``overlap_comm``, else 1) of the largest bucket;
- stage 3's whole parameters while modules run: the persistent small ones always, and up to
  ``stage3_max_live_parameters`` elements (at least the largest layer) during forward/backward;
- activations (when the transformer's dimensions are known): per layer, Korthikanti et al.'s
  count generalised to any dtype and FFN width, or the layer inputs plus one layer recomputed with
  activation checkpointing; the logits and their fp32 loss; pipeline stages hold their layers'
  activations for up to ``pipeline`` micro batches in flight (1F1B's first stage).

Data parallelism is ``world / (pipeline * tensor)``; a pipeline stage holds ``1/pipeline`` of the
parameters, a tensor slice ``1/tensor`` (tensor parallelism does not exist in dslaunch yet: the
degree is a what-if that divides parameters and activations, as Megatron with sequence
parallelism does).

Pure arithmetic and torch-free: the autotuner calls it for every candidate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from dslaunch.errors import UsageError
from dslaunch.runtime.estimate.shape import ModelShape

__all__ = ["TrainingSetup", "Parts", "MemoryEstimate", "estimate_memory", "OPTIMIZER_STATE_BYTES",
           "PRECISIONS", "OFFLOAD_DEVICES"]

Precision = Literal["fp32", "bf16", "fp16"]
Offload = Literal["none", "cpu", "nvme"]
PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")

# Optimizer state bytes per fp32 master element (torch's layouts, which dslaunch keeps).
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "lamb": 8, "adagrad": 4, "lion": 4,
    "sgd_momentum": 4, "sgd": 0,
}
MAX_INFLIGHT_BUFFERS = 2  # runtime/zero/reducer.py's; a test keeps the two equal
_MODEL_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
        tensor: tensor-parallel degree (a what-if: dslaunch has no tensor parallelism yet).
        reduce_bucket_size: elements per reduce bucket (``zero_optimization.reduce_bucket_size``).
        overlap_comm: reductions in flight while backward runs (more buckets alive).
        param_persistence_threshold, max_live_parameters: stage 3's knobs (DeepSpeed's names).
        max_in_cpu: with ``offload_param: nvme``, shard elements kept in host memory.
        zero_init: stage 3 models built under ``zero.Init`` (each rank never holds the whole model);
            else every local rank materialises the whole model in host memory before ``initialize``.
        accelerator: ``cuda`` (a device apart from host memory) or ``cpu`` (ranks on CPU: an
            offloaded fp32 master is still the weights, and nothing is staged).
        sub_group_size: elements per offloaded-step bucket (pinned staging on a GPU host).
        nvme_buffer_count, nvme_buffer_size: ``offload_optimizer``'s NVMe ring in host memory.
        param_buffer_count, param_buffer_size: ``offload_param``'s NVMe staging pool (16-bit
            shards, or a GPU): at most that many buffers, never more than the file's chunks.
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
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_in_cpu: int = 1_000_000_000
    zero_init: bool = True
    accelerator: Literal["cuda", "cpu"] = "cuda"
    sub_group_size: int = 1_000_000_000
    nvme_buffer_count: int = 4
    nvme_buffer_size: int = 100_000_000
    param_buffer_count: int = 4
    param_buffer_size: int = 100_000_000

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
        for name in ("micro_batch", "gpus_per_node", "nodes", "pipeline", "tensor", "reduce_bucket_size"):
            checks.append((getattr(self, name) >= 1, name, "a positive integer"))
        for ok, name, valid in checks:
            if not ok:
                raise UsageError(f"{name}: got {getattr(self, name)!r}; valid: {valid}")
        if self.world % (self.pipeline * self.tensor):
            raise UsageError(f"pipeline * tensor = {self.pipeline * self.tensor} must divide the "
                             f"world size {self.world} (gpus_per_node x nodes)")

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def data_parallel(self) -> int:
        return self.world // (self.pipeline * self.tensor)

    @classmethod
    def from_ds_config(cls, config: Mapping[str, Any], **overrides: Any) -> TrainingSetup:
        """The setup a ds_config dict describes; ``overrides`` (any field) win over it.

        Reads, does not validate: unknown keys are ignored and ``"auto"`` keeps the default (the
        engine validates the config when it runs). Cluster fields (``gpus_per_node``, ``nodes``,
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
            "activation_checkpointing": bool(_section(config, "activation_checkpointing")) or None,
            "reduce_bucket_size": zero.get("reduce_bucket_size"), "overlap_comm": zero.get("overlap_comm"),
            "param_persistence_threshold": _stage3(zero, "param_persistence_threshold"),
            "max_live_parameters": _stage3(zero, "max_live_parameters"),
            "max_in_cpu": par.get("max_in_cpu"), "sub_group_size": zero.get("sub_group_size"),
            "nvme_buffer_count": opt.get("buffer_count"), "nvme_buffer_size": opt.get("buffer_size"),
            "param_buffer_count": par.get("buffer_count"), "param_buffer_size": par.get("buffer_size"),
        }
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


@dataclass(frozen=True)
class Parts:
    """Bytes by purpose, in one place (a device, or one host's memory, or one host's disk)."""

    weights: int = 0
    gradients: int = 0
    master: int = 0
    optimizer_state: int = 0
    comm_buffers: int = 0
    gathered: int = 0  # stage 3: whole parameters while modules run (persistent ones included)
    buffers: int = 0  # the module's registered buffers
    activations: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def model_states(self) -> int:
        """Everything but activations."""
        return self.total - self.activations

    def __add__(self, other: Parts) -> Parts:
        return Parts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: Parts) -> Parts:
        return self + other.scaled(-1)

    def scaled(self, k: int) -> Parts:
        return Parts(**{f.name: getattr(self, f.name) * k for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class MemoryEstimate:
    """The estimate of one setup.

    Attributes:
        setup: what was estimated.
        device: one device's peak bytes while training, activations included (0 when unknown).
        host: one host's bytes (every local rank's host-resident state; pinned staging included).
        nvme: one host's bytes on disk (swap files of every local rank).
        activations_known: the model's dimensions and ``seq_len`` were known.
        host_init: one host's peak while the model is built, before training (ranks that
            materialise the whole model in host memory, ``zero_init`` off or below stage 3).
    """

    setup: TrainingSetup
    device: Parts
    host: Parts
    nvme: Parts
    activations_known: bool
    host_init: int

    @property
    def device_bytes(self) -> int:
        return self.device.total

    @property
    def host_bytes(self) -> int:
        """One host's peak: steady-state training or model building, whichever is larger."""
        return max(self.host.total, self.host_init)

    @property
    def rank_bytes(self) -> int:
        """One rank's tensors wherever they are (device + its share of host memory): on a CPU-only
        host, what a rank's process holds."""
        return self.device.total + self.host.total // self.setup.gpus_per_node

    def fits(self, device_memory: int, host_memory: int | None = None) -> bool:
        """Whether the device (and, if given, the host) peak fits."""
        return self.device_bytes <= device_memory and (host_memory is None or self.host_bytes <= host_memory)


def estimate_memory(shape: ModelShape, setup: TrainingSetup | Mapping[str, Any], **overrides: Any) -> MemoryEstimate:
    """Per-device and per-host bytes of training ``shape`` with ``setup``.

    Args:
        shape: the model.
        setup: a ``TrainingSetup``, or a ds_config dict (read by ``TrainingSetup.from_ds_config``).
        overrides: ``TrainingSetup`` fields that win over ``setup`` (e.g. ``gpus_per_node=8``).

    Returns:
        A ``MemoryEstimate``; exact for the model states of dslaunch's engine up to allocator
        rounding (the tests hold it within 10% of the tensors an engine holds), activations
        are a transformer formula (0 and ``activations_known=False`` without dimensions).

    Raises:
        UsageError: an invalid setup.
    """
    if not isinstance(setup, TrainingSetup):
        setup = TrainingSetup.from_ds_config(setup, **overrides)
    elif overrides:
        setup = setup.with_(**overrides)
    s = setup
    params = math.ceil(shape.params / (s.pipeline * s.tensor))  # this rank's model part
    dp = s.data_parallel
    shard = math.ceil(params / dp) if s.stage >= 1 else params  # the rank's range of master/state
    m = _MODEL_BYTES[s.precision]
    sixteen = m != 4
    device, host, disk = Parts(), Parts(), Parts()

    # Weights: whole below stage 3, the shard at stage 3 (where offload_param puts it).
    weights = params * m if s.stage < 3 else math.ceil(params / dp) * m
    if s.stage == 3 and s.offload_param == "cpu":
        host += Parts(weights=weights)
    elif s.stage == 3 and s.offload_param == "nvme":
        in_cpu = min(s.max_in_cpu, math.ceil(params / dp)) * m
        host += Parts(weights=in_cpu)
        disk += Parts(weights=weights - in_cpu)
        on_disk = (weights - in_cpu) // m
        if on_disk and (sixteen or s.accelerator == "cuda"):  # transfers that are no plain file read
            buffer = min(s.param_buffer_size, on_disk)
            host += Parts(comm_buffers=min(s.param_buffer_count, math.ceil(on_disk / buffer)) * buffer * m)
    else:
        device += Parts(weights=weights)

    # Gradients: whole (model dtype) at stages 0/1 plus an fp32 copy of the range for 16-bit;
    # the rank's fp32 shard at stages 2/3.
    grads = params * m + (shard * 4 if sixteen else 0) if s.stage < 2 else shard * 4
    device += Parts(gradients=grads)

    # Master and optimizer state: with the offloaded optimizer, or the stage-3 shard on the host,
    # they live in host memory. The fp32 master is a copy for 16-bit models, or where it lives
    # apart from the weights (on a CPU-only host the "offloaded" master still is the weights).
    weights_home = "nvme" if s.stage == 3 and s.offload_param == "nvme" else \
        "host" if s.stage == 3 and s.offload_param == "cpu" else "device"
    master_home = "host" if s.offload_optimizer != "none" or weights_home == "host" else "device"
    same = weights_home == master_home or (s.accelerator == "cpu" and weights_home != "nvme")
    master = shard * 4 if sixteen or not same else 0
    state = shard * OPTIMIZER_STATE_BYTES[s.optimizer]
    if master_home == "device":
        device += Parts(master=master, optimizer_state=state)
    else:
        host += Parts(master=master)
        if s.stage < 2 and sixteen:  # stages 0/1: the fp32 gradient copy is made next to the master
            device -= Parts(gradients=shard * 4)
            host += Parts(gradients=shard * 4)
        if s.offload_optimizer == "nvme":
            disk += Parts(optimizer_state=state)
            host += Parts(comm_buffers=_nvme_ring(s, shard))
        else:
            host += Parts(optimizer_state=state)
        if s.accelerator == "cuda" and s.offload_optimizer != "none":
            # pinned staging, two buckets ahead: gradients in, 16-bit parameters out
            bucket = min(s.sub_group_size, shard)
            host += Parts(comm_buffers=2 * bucket * 4 + (2 * bucket * m if sixteen else 0))

    # Reduce buckets (stages 2/3 stage every gradient through them).
    if s.stage >= 2:
        # A bucket holds whole parameters: a larger one gets a bucket of its own.
        largest_param = max(shape.param_sizes, default=shape.largest_layer) // s.tensor
        bucket = max(min(s.reduce_bucket_size, params), largest_param)
        count = min(MAX_INFLIGHT_BUFFERS + 1 if s.overlap_comm else 1, math.ceil(params / bucket))
        device += Parts(comm_buffers=bucket * m * count)

    # Stage 3: whole parameters while modules run.
    if s.stage == 3:
        persistent = shape.small_params(s.param_persistence_threshold) // (s.pipeline * s.tensor)
        live = min(params - persistent, max(s.max_live_parameters, shape.largest_layer // s.tensor))
        device += Parts(gathered=(persistent + live) * m)

    device += Parts(buffers=shape.buffer_bytes // (s.pipeline * s.tensor))
    acts = _activations(shape, s)
    if acts is not None:
        device += Parts(activations=acts)
    # Each local rank builds the model in fp32 host memory first: whole, or under zero.Init one
    # module at a time.
    built = shape.largest_layer if s.stage == 3 and s.zero_init else shape.params
    host_init = built * 4 * s.gpus_per_node
    k = s.gpus_per_node
    return MemoryEstimate(setup=s, device=device, host=host.scaled(k), nvme=disk.scaled(k),
                          activations_known=acts is not None, host_init=host_init)


def _nvme_ring(s: TrainingSetup, shard: int) -> int:
    """Bytes of ``offload_optimizer: nvme``'s ring in host memory: slots of one bucket of every
    state tensor, ``buffer_count // tensors`` of them, never more than the buckets of a pass."""
    tensors = max(1, OPTIMIZER_STATE_BYTES[s.optimizer] // 4)
    bucket = max(1, min(s.sub_group_size, s.nvme_buffer_size, shard))
    slots = max(1, min(s.nvme_buffer_count // tensors, math.ceil(shard / bucket)))
    return slots * tensors * bucket * 4


def _activations(shape: ModelShape, s: TrainingSetup) -> int | None:
    """Bytes of activations saved for backward on the busiest device; None when unknown."""
    if not shape.transformer or s.seq_len is None:
        return None
    m = _MODEL_BYTES[s.precision]
    b, t, h = s.micro_batch, s.seq_len, shape.hidden
    f = shape.ffn or 4 * h
    a = shape.heads or 1
    tokens = b * t
    scores = 0 if s.flash_attention else (2 * m + 1) * a * t * tokens  # softmax, its dropout and mask
    # Attention 5m+1 (inputs of QKV, Q, K, V, the projection; a dropout mask), MLP m+1 plus 2m per
    # FFN element, two norms 2m: Korthikanti et al.'s 34 sbh + 5 a s^2 b at m = 2, f = 4h.
    per_layer = tokens * h * (8 * m + 2) + 2 * m * tokens * f + scores
    per_layer = math.ceil(per_layer / s.tensor)
    layers = math.ceil(shape.layers / s.pipeline)
    if s.activation_checkpointing:  # the layers' inputs, and one layer recomputed in backward
        stored = layers * tokens * h * m + per_layer
    else:
        stored = layers * per_layer
    in_flight = s.pipeline  # 1F1B: the first stage holds `pipeline` micro batches' activations
    logits = tokens * (shape.vocab or 0) * (m + 4) // s.tensor  # logits and their fp32 loss input
    return stored * in_flight + logits
