"""DeepSpeed's own estimator (``estimate_zero2/3_model_states_mem_needs*``), number for number.

A compatibility mode: the functions at DeepSpeed's paths (``runtime/zero/stage_1_and_2.py``,
``runtime/zero/stage3.py``) print these tables, so scripts and notebooks written against
DeepSpeed 0.19.8 print what they printed there. The numbers are DeepSpeed's formulas, not
dslaunch's engine; ``dslaunch estimate`` (``memory.estimate_memory``) is the estimate of what
dslaunch actually holds. What the formulas leave out: activations, ZeRO-1, NVMe, bf16 vs fp32
(2-byte parameters are assumed), communication buffers and stage 3's live parameters beyond one
layer; ``additional_buffer_factor`` (1.5) pads the host side by hand.

The table's option column formats DeepSpeed's ``OffloadDeviceEnum`` member as DeepSpeed does
(``f"{member:4}"``), which Python 3.11 and later render as ``OffloadDeviceEnum.cpu`` and 3.10 as
``cpu ``: the same enum kind gives the same text on every Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any

__all__ = ["OffloadDeviceEnum", "zero2_mem_needs", "zero3_mem_needs", "zero2_table", "zero3_table",
           "count_params", "count_params_and_largest_layer",
           "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
           "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold"]

GiB = 2**30


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload devices (``deepspeed.runtime.zero.offload_config``), for the table's text."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def zero2_mem_needs(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                    cpu_offload: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int]:
    """DeepSpeed's ZeRO-2 formula: (host bytes per node, bytes per GPU).

    GPU: 2-byte parameters whole, plus, without offload, 16-bit gradients, fp32 gradients, fp32
    master and two Adam moments (18 bytes) partitioned. Host: with offload the larger of
    4 bytes x GPUs and 16 bytes per parameter, else 4 bytes per parameter per local GPU (loading),
    times the buffer factor.
    """
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def zero3_mem_needs(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                    num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                    zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, Any]:
    """DeepSpeed's ZeRO-3 formula: (host bytes per node, bytes per GPU, largest layer bytes).

    The GPU always holds one largest layer in fp32 (4 bytes per element), plus the 2-byte
    parameter shard unless parameters are offloaded, plus the 18 bytes of gradients, master and
    moments per shard element without any offload. The host holds 18 (parameters offloaded) or 16
    bytes per parameter spread over the nodes, or, without ``zero_init``, at least 4 bytes per
    parameter per local GPU (every rank loads the whole model); without offload, only what loading
    needs. The third value keeps DeepSpeed's type (a float for float input).
    """
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    layer = 4 * largest_layer_params
    loading = 4 * num_gpus_per_node  # bytes per parameter when every local rank loads the model
    if not cpu_offload:
        gpu = layer + int(18 * total_params / gpus)
        cpu = (largest_layer_params if zero_init else total_params) * loading * additional_buffer_factor
        return int(cpu), int(gpu), layer
    host_bytes = 18 if cpu_offload_params else 16
    gpu = layer if cpu_offload_params else layer + int(2 * total_params / gpus)
    factor = host_bytes * per_node if zero_init else max(loading, host_bytes * per_node)
    return int(total_params * factor * additional_buffer_factor), int(gpu), layer


def count_params(parameters: Iterable[Any]) -> int:
    """Parameters counted as DeepSpeed does: a storage address counted once (tied weights).

    Meta tensors, which all report address 0, are told apart by identity instead (DeepSpeed
    would count one of them)."""
    seen: dict[Any, int] = {}
    for p in parameters:
        key = id(p) if p.device.type == "meta" else p.data_ptr()
        seen[key] = p.numel()
    return sum(seen.values())


def count_params_and_largest_layer(model: Any) -> tuple[int, int]:
    """(parameters, the most parameters one module holds itself), as DeepSpeed's stage 3 counts."""
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return count_params(model.parameters()), largest


def _header(total_params: float, num_gpus_per_node: int, num_nodes: int, extra: str = "") -> str:
    nodes = "nodes" if num_nodes > 1 else "node"
    gpus = "GPUs" if num_gpus_per_node > 1 else "GPU"
    return ("Estimated memory needed for params, optim states and gradients for a:\n"
            f"HW: Setup with {num_nodes} {nodes}, {num_gpus_per_node} {gpus} per node.\n"
            f"SW: Model with {int(total_params / 1e6)}M total params{extra}.\n"
            "  per CPU  |  per GPU |   Options")


def _row(cpu: int, gpu: int, options: str) -> str:
    return f" {cpu / GiB:7.2f}GB | {gpu / GiB:6.2f}GB | {options}"


def _device(offloaded: bool) -> str:
    return f"{OffloadDeviceEnum.cpu:4}" if offloaded else "none"


def zero2_table(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                additional_buffer_factor: float = 1.5) -> str:
    """DeepSpeed's ZeRO-2 table (with and without optimizer offload), as it prints it."""
    lines = [_header(total_params, num_gpus_per_node, num_nodes)]
    for offload in (True, False):
        cpu, gpu = zero2_mem_needs(total_params, num_gpus_per_node, num_nodes, offload, additional_buffer_factor)
        lines.append(_row(cpu, gpu, f"offload_optimizer={_device(offload)}"))
    return "\n".join(lines)


def zero3_table(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> str:
    """DeepSpeed's ZeRO-3 table (parameter/optimizer offload, zero_init on/off), as it prints it."""
    lines = [_header(total_params, num_gpus_per_node, num_nodes,
                     f", {int(largest_layer_params / 1e6)}M largest layer params")]
    combos = [(True, True), (True, False), (False, False)]  # parameter offload needs optimizer offload
    for offload, offload_params in combos:
        for zero_init in (True, False):
            cpu, gpu, _ = zero3_mem_needs(total_params, largest_layer_params, num_gpus_per_node, num_nodes,
                                          offload, offload_params, zero_init, additional_buffer_factor)
            options = (f"offload_param={_device(offload_params)}, offload_optimizer={_device(offload)}, "
                       f"zero_init={int(zero_init)}")
            lines.append(_row(cpu, gpu, options))
    return "\n".join(lines)


# ----- DeepSpeed's names and signatures (re-exported by runtime/zero/stage_1_and_2.py and stage3.py) -----

estimate_zero2_model_states_mem_needs = zero2_mem_needs
estimate_zero3_model_states_mem_needs = zero3_mem_needs


def estimate_zero2_model_states_mem_needs_all_live(model: Any, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-2 table for ``model`` (an ``nn.Module``; tied weights counted once).

    For dslaunch's own estimate (every stage, NVMe, bf16, activations) run ``dslaunch estimate``.
    """
    estimate_zero2_model_states_mem_needs_all_cold(count_params(model.parameters()), num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: float, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1, additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-2 table for a model of ``total_params`` parameters."""
    print(zero2_table(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor))


def estimate_zero3_model_states_mem_needs_all_live(model: Any, num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-3 table for ``model`` (its largest layer: the most parameters one
    module holds itself)."""
    total, largest = count_params_and_largest_layer(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: float, largest_layer_params: float,
                                                   num_gpus_per_node: int = 1, num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    """Print DeepSpeed's ZeRO-3 table for a model of ``total_params`` parameters."""
    print(zero3_table(total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor))
