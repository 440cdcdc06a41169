"""The engine configurations that ``check.sh`` runs on CUDA and on CPU: name -> ds_config.

``python scripts/gpu/configs.py DIR`` writes ``DIR/<name>.json`` for each, one per line on stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 4}},
}


def _zero(stage: int, **extra: Any) -> dict[str, Any]:
    return {"zero_optimization": {"stage": stage, **extra}}


def configs(nvme_path: str) -> dict[str, dict[str, Any]]:
    cpu_opt = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    nvme = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True}
    bf16, fp16 = {"bf16": {"enabled": True}}, {"fp16": {"enabled": True, "initial_scale_power": 8}}
    cases = {
        "z0": _zero(0), "z1": _zero(1), "z2": _zero(2), "z3": _zero(3),
        "z2_bf16": {**_zero(2), **bf16}, "z3_bf16": {**_zero(3), **bf16}, "z2_fp16": {**_zero(2), **fp16},
        "z2_offload": _zero(2, **cpu_opt),
        "z3_offload": _zero(3, **cpu_opt, offload_param={"device": "cpu", "pin_memory": True}),
        "z3_offload_bf16": {**_zero(3, **cpu_opt, offload_param={"device": "cpu", "pin_memory": True}), **bf16},
        "z3_nvme": _zero(3, offload_optimizer=nvme, offload_param=nvme),
        "z0_adam_fused": {**_zero(0), "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
    }
    return {name: {**BASE, **cfg} for name, cfg in cases.items()}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, cfg in configs(str(out / "nvme")).items():
        (out / f"{name}.json").write_text(json.dumps(cfg, indent=1))
        print(name)
