"""Compression scenarios run the same way by dslaunch (``test_against_deepspeed.py``) and by
DeepSpeed 0.19.6's compression library (``deepspeed_reference.py``, in the DeepSpeed venv): a small
BERT-like model and a small CNN, a ds_config block, a few SGD steps with the compression scheduler
stepped as the engine steps it, then ``redundancy_clean``. Pure torch: the caller passes the API
(``init_compression``, ``redundancy_clean``, ``student_initialization``, ``compression_scheduler``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

HIDDEN, HEADS, VOCAB, STEPS = 16, 4, 32, 8


class SelfAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)


class Output(nn.Module):
    def __init__(self, fan_in: int) -> None:
        super().__init__()
        self.dense = nn.Linear(fan_in, HIDDEN)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self, self.output = SelfAttn(), Output(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HEADS, -1).transpose(1, 2) for m in (self.self.query, self.self.key, self.self.value))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1) @ v
        return self.output.dense(a.transpose(1, 2).reshape(b, t, -1))


class Intermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(HIDDEN, 4 * HIDDEN)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.intermediate, self.output = Attention(), Intermediate(), Output(4 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.output.dense(torch.nn.functional.gelu(self.intermediate.dense(x)))


class TinyBert(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layer = nn.ModuleList(Layer() for _ in range(layers))
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(ids)
        for layer in self.layer:
            x = layer(x)
        return self.head(x.mean(dim=1))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(torch.relu(self.conv2(x)).mean(dim=(2, 3)))


def _group(params: dict, modules: list, related: list | None = None) -> dict:
    g = {"params": params, "modules": modules}
    return {**g, "related_modules": related} if related is not None else g


def _shared(**kw: Any) -> dict:
    return {"enabled": True, **kw}


CONFIGS: dict[str, dict] = {
    "quant": {
        "weight_quantization": {"shared_parameters": _shared(schedule_offset=2, quantize_weight_in_forward=True,
                                                             quantization_type="asymmetric", quantize_groups=2),
                                "different_groups": {
                                    "wq1": _group({"start_bits": 8, "target_bits": 8}, ["attention.self"]),
                                    "wq2": _group({"start_bits": 8, "target_bits": 4}, ["output.dense", "embeddings"])}},
        "activation_quantization": {"shared_parameters": _shared(schedule_offset=3, quantization_type="asymmetric"),
                                    "different_groups": {"aq1": _group({"bits": 8}, ["attention.output"])}},
    },
    "quant_static": {
        "weight_quantization": {"shared_parameters": _shared(schedule_offset=0, quantize_weight_in_forward=True),
                                "different_groups": {"wq": _group({"start_bits": 4, "target_bits": 2}, ["intermediate"])}},
        "activation_quantization": {"shared_parameters": _shared(schedule_offset=1, range_calibration="static"),
                                    "different_groups": {"aq": _group({"bits": 4}, ["intermediate", "head"])}},
    },
    "prune": {
        "sparse_pruning": {"shared_parameters": _shared(schedule_offset=1, method="l1"),
                           "different_groups": {"sp1": _group({"dense_ratio": 0.5}, ["attention.self"])}},
        "row_pruning": {"shared_parameters": _shared(schedule_offset=2, method="topk"),
                        "different_groups": {"rp1": _group({"dense_ratio": 0.5}, ["intermediate.dense"],
                                                           [["layer.\\w+.output.dense"]])}},
        "head_pruning": {"shared_parameters": _shared(schedule_offset=3, method="topk", num_heads=HEADS),
                         "different_groups": {"hp1": _group({"dense_ratio": 0.5}, ["attention.output.dense"],
                                                            [["self.query", "self.key", "self.value"]])}},
    },
    "prune_topk_sparse": {
        "sparse_pruning": {"shared_parameters": _shared(schedule_offset=0, method="topk"),
                           "different_groups": {"sp": _group({"dense_ratio": 0.3}, ["intermediate", "head"])}},
        "row_pruning": {"shared_parameters": _shared(schedule_offset=1, method="l1"),
                        "different_groups": {"rp": _group({"dense_ratio": 0.25}, ["head"])}},
    },
    "cnn": {
        "weight_quantization": {"shared_parameters": _shared(schedule_offset=0, quantize_weight_in_forward=True),
                                "different_groups": {"wq": _group({"start_bits": 8, "target_bits": 6}, ["conv2", "fc"])}},
        "activation_quantization": {"shared_parameters": _shared(schedule_offset=2),
                                    "different_groups": {"aq": _group({"bits": 8}, ["conv2"])}},
        "sparse_pruning": {"shared_parameters": _shared(schedule_offset=1, method="topk"),
                           "different_groups": {"sp": _group({"dense_ratio": 0.5}, ["conv2"])}},
        "channel_pruning": {"shared_parameters": _shared(schedule_offset=2, method="topk"),
                            "different_groups": {"cp": _group({"dense_ratio": 0.5}, ["conv1"], [["bn1", "conv2"]])}},
    },
    "cnn_topk": {
        "channel_pruning": {"shared_parameters": _shared(schedule_offset=0, method="topk"),
                            "different_groups": {"cp": _group({"dense_ratio": 0.75}, ["conv1"], [["bn1", "conv2"]])}},
    },
}
LAYER_REDUCTION = {"layer_reduction": {"enabled": True, "keep_number_layer": 2, "module_name_prefix": "layer",
                                       "teacher_layer": [1, 3], "other_module_name": ["embeddings", "head"]}}


def _inputs(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if name.startswith("cnn"):
        return torch.randn(4, 3, 6, 6, generator=gen)
    return torch.randint(0, VOCAB, (4, 5), generator=gen)


def _tolist(t: torch.Tensor) -> list:
    return t.detach().double().flatten().tolist()


def run(api: Any, name: str) -> dict:
    """One scenario: losses per step, the trained weights, the shapes and output after the clean."""
    torch.manual_seed(1234)
    model = TinyCNN() if name.startswith("cnn") else TinyBert()
    config = {"train_batch_size": 4, "compression_training": CONFIGS[name]}
    model = api.init_compression(model, config)
    scheduler = api.scheduler(model, config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, losses = _inputs(name), []
    for step in range(STEPS):
        if step == 0:
            scheduler.step(step_zero_check=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    before = model(x)
    api.redundancy_clean(model, config)
    after = model(x)
    return {"losses": losses, "before": _tolist(before), "after": _tolist(after),
            "state": {k: _tolist(v) for k, v in model.state_dict().items()},
            "shapes": {k: list(v.shape) for k, v in model.state_dict().items()}}


def run_layer_reduction(api: Any) -> dict:
    torch.manual_seed(99)
    teacher, student = TinyBert(layers=4), TinyBert(layers=2)
    config = {"train_batch_size": 4, "compression_training": LAYER_REDUCTION}
    api.init_compression(student, config, teacher_model=teacher)
    return {"state": {k: _tolist(v) for k, v in student.state_dict().items()}}


def run_all(api: Any) -> dict:
    return {**{name: run(api, name) for name in CONFIGS}, "layer_reduction": run_layer_reduction(api)}
