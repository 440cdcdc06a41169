"""``dslaunch estimate``: per-GPU and per-node memory of every ZeRO stage, offload and precision.

The model is a parameter count (``--params 7B --largest_layer 131M``), a Hugging Face
``config.json`` (``--hf_config``) or a function that builds it (``--model pkg.mod:build``, built on
the meta device). A thin click command: the estimate is ``dslaunch.runtime.estimate``.
``--deepspeed`` prints DeepSpeed's own ZeRO-2/3 tables instead (its formulas, for comparison).
"""

from __future__ import annotations

import json
import re

import click

from dslaunch.errors import UsageError, shorten

__all__ = ["command", "parse_count", "parse_bytes"]

_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_BYTE_SUFFIX = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
                "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}
_NUMBER = re.compile(r"^([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)$")


def _parse(option: str, text: str, suffixes: dict[str, int], valid: str) -> int:
    m = _NUMBER.match(text.strip())
    unit = m.group(2).upper() if m else ""
    if not m or unit not in suffixes:
        raise UsageError(f"dslaunch estimate {option}: {shorten(text, 60)!r} is not {valid}")
    value = int(float(m.group(1)) * suffixes[unit])
    if value <= 0:
        raise UsageError(f"dslaunch estimate {option}: must be positive, got {shorten(text, 60)!r}")
    return value


def parse_count(option: str, text: str) -> int:
    """``7e9``, ``7B``, ``1.3B``, ``125M``, ``350K`` -> an element count."""
    return _parse(option, text, _COUNT_SUFFIX, "a count such as 7e9, 7B, 125M or 350K")


def parse_bytes(option: str, text: str) -> int:
    """``80GB``, ``80GiB``, ``81920MB``: binary units (GB = GiB, as GPU memory is quoted)."""
    return _parse(option, text, _BYTE_SUFFIX, "a size such as 80GB, 80GiB or 24576MB (GB = 2^30 bytes)")


def _csv(option: str, text: str, valid: tuple[str, ...]) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in valid]
    if bad or not items:
        raise UsageError(f"dslaunch estimate {option}: {shorten(text, 60)!r}; valid: a comma list of "
                         f"{', '.join(valid)}")
    return items


def _shape(params: str | None, largest_layer: str | None, hf_config: str | None, model: str | None):
    from dslaunch.runtime.estimate import ModelShape, from_builder, from_hf_config

    given = [name for name, v in (("--params", params), ("--hf_config", hf_config), ("--model", model)) if v]
    if len(given) != 1:
        raise UsageError("dslaunch estimate: give the model as exactly one of --params N (with "
                         "--largest_layer), --hf_config config.json or --model MODULE:FUNCTION"
                         + (f" (got {', '.join(given)})" if given else ""))
    if hf_config:
        return from_hf_config(hf_config)
    if model:
        return from_builder(model)
    total = parse_count("--params", params)
    largest = parse_count("--largest_layer", largest_layer) if largest_layer else 0
    if largest > total:
        raise UsageError(f"dslaunch estimate --largest_layer: {largest_layer} exceeds --params {params}")
    return ModelShape.from_counts(total, largest)


def _base_config(path: str | None) -> dict:
    if path is None:
        return {}
    from pathlib import Path

    from dslaunch.runtime.config.file import read_config_file

    raw = read_config_file(Path(path))
    if not isinstance(raw, dict):
        raise UsageError(f"dslaunch estimate --deepspeed_config {shorten(path, 200)}: expected a JSON object")
    return raw


@click.command("estimate")
@click.option("--params", help="Trainable parameters: 7e9, 7B, 125M.")
@click.option("--largest_layer", help="Parameters of the largest module (ZeRO-3 gathers it whole): 131M.")
@click.option("--hf_config", type=click.Path(dir_okay=False), help="A Hugging Face config.json (a decoder).")
@click.option("--model", help="MODULE:FUNCTION returning the nn.Module (called on the meta device).")
@click.option("--hidden", type=click.IntRange(min=1), help="Hidden size (for activations).")
@click.option("--layers", type=click.IntRange(min=1), help="Transformer layers (for activations).")
@click.option("--heads", type=click.IntRange(min=1), help="Attention heads.")
@click.option("--vocab", type=click.IntRange(min=1), help="Vocabulary size (the logits).")
@click.option("--ffn", type=click.IntRange(min=1), help="MLP inner size (default 4 x hidden).")
@click.option("--num_gpus", type=click.IntRange(min=1), default=1, show_default=True, help="GPUs per node.")
@click.option("--num_nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Nodes.")
@click.option("--micro_batch", type=click.IntRange(min=1), help="Micro batch per GPU (default: the config's, or 1).")
@click.option("--seq_len", type=click.IntRange(min=1), help="Tokens per sample (activations need it).")
@click.option("--precision", help="Comma list of fp32, bf16, fp16 (default: the config's, else bf16).")
@click.option("--stages", default="0,1,2,3", show_default=True, help="Comma list of ZeRO stages.")
@click.option("--offload", default="none,cpu,nvme", show_default=True, help="Offload devices to try.")
@click.option("--optimizer", default=None, help="adamw (default), adam, adagrad, lion, sgd, sgd_momentum, lamb.")
@click.option("--pipeline", type=click.IntRange(min=1), default=1, show_default=True, help="Pipeline stages.")
@click.option("--tensor", type=click.IntRange(min=1),
              help="Tensor-parallel degree (AutoTP training; default: the config's tensor_parallel.autotp_size, or 1).")
@click.option("--sequence_parallel_size", "sequence", type=click.IntRange(min=1),
              help="Ranks that split each sequence (Ulysses; default: the config's, or 1).")
@click.option("--expert_parallel_size", "expert_parallel", type=click.IntRange(min=1),
              help="Ranks each MoE layer's experts are spread over (default: the config's AutoEP size, or 1).")
@click.option("--expert_params", help="With --params: how many of them are MoE experts' (all experts): 45B.")
@click.option("--num_experts", type=click.IntRange(min=1), help="Experts per MoE layer (with --params).")
@click.option("--flash_attention", is_flag=True, help="Attention stores no seq x seq scores.")
@click.option("--no_attention", is_flag=True, help="Layers are residual MLP blocks without attention.")
@click.option("--no_zero_init", is_flag=True, help="Stage 3 models not built under zero.Init.")
@click.option("--accelerator", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: ranks on the CPU (gloo); adds what /dev/shm must hold (docker run --shm-size).")
@click.option("--gpu_memory", help="Device memory to fit: 80GB (GB = 2^30 bytes).")
@click.option("--cpu_memory", help="Host memory per node to fit.")
@click.option("--deepspeed_config", type=click.Path(dir_okay=False),
              help="A ds_config whose precision, optimizer, buckets, stage-3 knobs and micro batch the rows keep.")
@click.option("--json", "as_json", is_flag=True, help="JSON rows for tools instead of the table.")
@click.option("--deepspeed", "deepspeed_tables", is_flag=True,
              help="Print DeepSpeed's own ZeRO-2/3 tables (its formulas) instead.")
def command(params, largest_layer, hf_config, model, hidden, layers, heads, vocab, ffn, num_gpus, num_nodes,
            micro_batch, seq_len, precision, stages, offload, optimizer, pipeline, tensor, sequence, expert_parallel,
            expert_params, num_experts, flash_attention, no_attention, no_zero_init, accelerator, gpu_memory, cpu_memory,
            deepspeed_config, as_json, deepspeed_tables) -> int:
    """Per-GPU and per-node memory of every ZeRO stage, offload and precision, sorted by what fits."""
    from dslaunch.runtime.estimate import PRECISIONS, TrainingSetup
    from dslaunch.runtime.estimate import sweep as sw

    if (expert_params or num_experts) and not params:
        raise UsageError("dslaunch estimate --expert_params/--num_experts: only with --params (a config or a "
                         "model given counts its own experts)")
    experts = parse_count("--expert_params", expert_params) if expert_params else None
    shape = _shape(params, largest_layer, hf_config, model).with_dims(
        hidden=hidden, layers=layers, heads=heads, vocab=vocab, ffn=ffn, attention=False if no_attention else None,
        expert_params=experts, num_experts=num_experts)
    if deepspeed_tables:
        from dslaunch.runtime.estimate.deepspeed_formulas import zero2_table, zero3_table

        click.echo(zero2_table(shape.params, num_gpus, num_nodes))
        click.echo(zero3_table(shape.params, shape.largest_layer, num_gpus, num_nodes))
        return 0
    overrides = {"gpus_per_node": num_gpus, "nodes": num_nodes, "seq_len": seq_len, "pipeline": pipeline,
                 "flash_attention": flash_attention, "zero_init": not no_zero_init, "accelerator": accelerator}
    overrides.update({k: v for k, v in (("micro_batch", micro_batch), ("optimizer", optimizer), ("sequence", sequence),
                                        ("expert_parallel", expert_parallel), ("tensor", tensor)) if v is not None})
    base = TrainingSetup.from_ds_config(_base_config(deepspeed_config), **overrides)
    stage_list = tuple(int(x) for x in _csv("--stages", stages, ("0", "1", "2", "3")))
    if precision is None:
        precision = base.precision if deepspeed_config else "bf16"
    rows = sw.sweep(shape, sw.setups(base, stage_list, _csv("--precision", precision, PRECISIONS),
                                     _csv("--offload", offload, ("none", "cpu", "nvme"))))
    device = parse_bytes("--gpu_memory", gpu_memory) if gpu_memory else None
    host = parse_bytes("--cpu_memory", cpu_memory) if cpu_memory else None
    rows = sw.sort_rows(rows, device, host)
    if as_json:
        click.echo(json.dumps({"model": {k: v for k, v in shape.__dict__.items() if k != "param_sizes"},
                               "gpu_memory": device, "cpu_memory": host,
                               "rows": sw.rows_as_json(rows, device, host)}, indent=1))
    else:
        click.echo(sw.format_table(shape, rows, device, host))
    return 0
