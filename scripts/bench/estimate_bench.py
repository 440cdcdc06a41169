"""The memory estimator against the engine, and DeepSpeed's formulas against the same measurement.

A 2-rank gloo job trains an MLP of ``LAYERS`` x (Linear(DIM, DIM), LayerNorm(DIM)) for two steps
under each configuration below (AdamW; ZeRO 0-3; fp32 and bf16; CPU and NVMe offload of the
optimizer and of stage 3's parameters; stage 3 with the default and a bounded live-parameter
budget) and records the peak bytes of the tensors each rank's engine holds
(``tests/runtime/estimate/peak.py``: the engine's object graph walked at every layer's forward,
every weight gradient and after each step). Compared with:

- ``dslaunch estimate`` (``estimate_memory``, ``accelerator="cpu"``): one rank's device bytes plus
  its share of the host's;
- DeepSpeed 0.19.8's formulas (``estimate_zero2/3_model_states_mem_needs``, run from dslaunch's
  copy of its numbers; ``additional_buffer_factor=1``): its per-GPU bytes, plus per-CPU / GPUs per
  node with offload. It has no stage 0/1, NVMe or precision: "-" there.

Swap files on NVMe are not tensors and are not counted on either side. Nothing here is a timing.

Activations (a second table): a GPT-like model (``ACT`` dims: pre-norm blocks, SDPA attention,
a 4x GeLU MLP, dropout 0.1, an LM head) and a residual-MLP model (the same blocks without
attention), with and without ``deepspeed.checkpointing`` on every block, at micro batches
``ACT_BATCHES``, on one fp32 ZeRO-0 engine: the most bytes of the tensors one forward + backward
creates alive at once (``LiveBytes``, a dispatch mode counting each storage from creation to
free), less the gradients that outlive it (model states, counted above), against
``estimate_memory(...).device.activations``.

Usage: python scripts/bench/estimate_bench.py   (writes scripts/bench/results/estimate_bench.{json,md})
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed import run_world  # noqa: E402

DIM, LAYERS, BATCH, WORLD = 1024, 6, 8, 2
ADAMW = {"type": "AdamW", "params": {"lr": 1e-4}}
BF16 = {"bf16": {"enabled": True}}
LIVE = 2 * DIM * DIM  # stage3_max_live_parameters: two layers
ACT_BATCHES = (2, 4, 8)


def _configs(nvme: str) -> dict[str, dict]:
    cpu = {"device": "cpu"}
    return {
        "zero0 fp32": {"zero_optimization": {"stage": 0}},
        "zero0 bf16": {"zero_optimization": {"stage": 0}, **BF16},
        "zero1 fp32": {"zero_optimization": {"stage": 1}},
        "zero1 bf16": {"zero_optimization": {"stage": 1}, **BF16},
        "zero2 fp32": {"zero_optimization": {"stage": 2}},
        "zero2 bf16": {"zero_optimization": {"stage": 2}, **BF16},
        "zero3 fp32": {"zero_optimization": {"stage": 3}},
        "zero3 bf16": {"zero_optimization": {"stage": 3}, **BF16},
        "zero3 bf16 live=2 layers": {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": LIVE}, **BF16},
        "zero2 bf16 offload cpu": {"zero_optimization": {"stage": 2, "offload_optimizer": cpu}, **BF16},
        "zero3 fp32 offload opt+param cpu": {"zero_optimization": {"stage": 3, "offload_optimizer": cpu,
                                                                   "offload_param": cpu}},
        "zero2 fp32 offload nvme": {"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": nvme}}},
        "zero3 bf16 opt+param nvme": {"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": nvme}, "offload_param": {"device": "nvme", "nvme_path": nvme,
                                                                    "max_in_cpu": 0}}, **BF16},
    }


def _build():
    import torch

    return torch.nn.Sequential(*[m for _ in range(LAYERS) for m in (torch.nn.Linear(DIM, DIM), torch.nn.LayerNorm(DIM))])


def _measure(rank: int, world: int, configs: dict[str, dict]) -> dict[str, int]:
    import torch

    from tests.runtime.estimate.peak import engine_peak

    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        full = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "optimizer": ADAMW,
                "shared_memory_collectives": "never", **cfg}  # shared memory: tests/runtime/estimate/test_shared_memory.py
        out[name] = engine_peak(_build(), full, lambda dtype: torch.randn(BATCH, DIM, dtype=dtype))
    return out


def _deepspeed(shape, cfg: dict) -> int | None:
    """DeepSpeed's formula for one rank's bytes (None where it has none)."""
    from dslaunch.runtime.estimate.deepspeed_formulas import zero2_mem_needs, zero3_mem_needs

    zero = cfg["zero_optimization"]
    opt = zero.get("offload_optimizer", {}).get("device", "none")
    par = zero.get("offload_param", {}).get("device", "none")
    if zero["stage"] < 2 or "nvme" in (opt, par) or "bf16" not in cfg:
        return None  # no ZeRO-0/1, NVMe or fp32 in its formulas
    if zero["stage"] == 2:
        cpu, gpu = zero2_mem_needs(shape.params, WORLD, 1, opt == "cpu", 1.0)
    else:
        cpu, gpu, _ = zero3_mem_needs(shape.params, shape.largest_layer, WORLD, 1, opt == "cpu", par == "cpu", True, 1.0)
    return gpu + (cpu // WORLD if opt == "cpu" else 0)


def _measure_activations(rank: int, world: int) -> list[dict]:
    from tests.runtime.estimate.peak import measure_activations

    return measure_activations(_act_models(), ACT_BATCHES)


def _act_models():
    from tests.runtime.estimate.peak import ActivationModels

    return ActivationModels(layers=4, hidden=256, heads=4, seq=128, vocab=1024)


def _activation_rows() -> list[dict]:
    from dslaunch.runtime.estimate import TrainingSetup, estimate_memory

    models = _act_models()
    rows = []
    for row in run_world(_measure_activations, 1, timeout=600)[0]:
        setup = TrainingSetup(micro_batch=row["micro_batch"], seq_len=models.seq, flash_attention=True,
                              activation_checkpointing=row["checkpointing"], accelerator="cpu")
        est = estimate_memory(models.shape(row["model"] == "gpt"), setup).device.activations
        rows.append({**row, "estimate": est, "error": est / row["peak"] - 1})
    return rows


def _activation_lines(rows: list[dict]) -> list[str]:
    m = _act_models()
    mib = 2**20
    lines = ["\n### Activations against a real forward + backward\n",
             f"{m.layers} blocks, hidden {m.hidden}, {m.heads} heads, sequence {m.seq}; GPT-like (vocabulary "
             f"{m.vocab}) and residual-MLP (the blocks without attention); fp32, one ZeRO-0 engine. Peak: the "
             "most bytes of tensors created by one forward + backward alive at once, less the gradients that "
             "outlive it. MiB.\n",
             "| model | checkpointing | micro batch | held after forward | peak | estimate | error |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {'yes' if r['checkpointing'] else 'no'} | {r['micro_batch']} | "
                     f"{r['held_after_forward'] / mib:.1f} | {r['peak'] / mib:.1f} | {r['estimate'] / mib:.1f} | "
                     f"{r['error']:+.1%} |")
    return lines


def main() -> int:
    import torch

    from dslaunch.runtime.estimate import estimate_memory, from_module

    with torch.device("meta"):
        shape = from_module(_build())
    activations = _activation_rows()
    with tempfile.TemporaryDirectory(prefix="dsl-est-bench-") as nvme:
        configs = _configs(nvme)
        measured = run_world(_measure, WORLD, configs, timeout=600)
    rows = []
    for name, cfg in configs.items():
        est = estimate_memory(shape, cfg, gpus_per_node=WORLD, accelerator="cpu", micro_batch=BATCH,
                              shared_memory=False)  # as measured
        got = max(r[name] for r in measured)
        ds = _deepspeed(shape, cfg)
        rows.append({"config": name, "measured_bytes": got, "estimate_bytes": est.rank_bytes,
                     "estimate_error": est.rank_bytes / got - 1, "deepspeed_bytes": ds,
                     "deepspeed_error": None if ds is None else ds / got - 1,
                     "device": est.device.as_dict(), "host_per_node": est.host.as_dict()})
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / "estimate_bench.json").write_text(json.dumps({
        "model": {"params": shape.params, "largest_layer": shape.largest_layer, "dim": DIM, "layers": LAYERS},
        "world": WORLD, "micro_batch": BATCH, "rows": rows, "activations": activations}, indent=1))
    mib = 2**20
    lines = ["## Memory estimator against the engine (`scripts/bench/estimate_bench.py`)\n",
             f"{shape.params / 1e6:.1f}M-parameter MLP ({LAYERS} x Linear({DIM}, {DIM}) + LayerNorm), AdamW, "
             f"{WORLD} gloo ranks: peak bytes of the tensors one rank's engine holds over two steps, against "
             "`dslaunch estimate` and DeepSpeed 0.19.8's formulas (buffer factor 1; '-': no formula for that "
             "setup). MiB.\n",
             "| config | measured | dslaunch estimate | error | DeepSpeed formula | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ds = "-" if r["deepspeed_bytes"] is None else f"{r['deepspeed_bytes'] / mib:.1f}"
        dse = "-" if r["deepspeed_error"] is None else f"{r['deepspeed_error']:+.1%}"
        lines.append(f"| {r['config']} | {r['measured_bytes'] / mib:.1f} | {r['estimate_bytes'] / mib:.1f} | "
                     f"{r['estimate_error']:+.1%} | {ds} | {dse} |")
    lines += _activation_lines(activations)
    (results / "estimate_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
