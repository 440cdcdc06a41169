"""An AutoEP training job that real DeepSpeed and dslaunch both run, for the AutoEP checkpoint
interop tests (``test_deepspeed_autoep.py``); run as ``deepspeed_job.py`` is (``main``).

The model: a Mixtral-shaped MoE block at ``model.layers.0.mlp`` (router ``gate``, fused ``experts.gate_up_proj`` and
``experts.down_proj``, top-2 of 4 experts) between two linear layers; AutoEP converts the block at
``initialize`` (``expert_parallel``, preset ``mixtral``). A fixed global batch of 8 tokens' rows
per step is split evenly over the ranks, so the mean of the ranks' losses is the same at any world
size that divides 8 (``deepspeed_job.batch``).
"""

from __future__ import annotations

from typing import Any

import torch

try:  # run as a script: its folder is on the path
    import deepspeed_job
except ImportError:
    from tests.runtime.checkpoint import deepspeed_job

GLOBAL_BATCH, HIDDEN, FFN, EXPERTS = deepspeed_job.GLOBAL_BATCH, 8, 6, 4


class _Config:
    model_type = "mixtral"
    num_local_experts = EXPERTS
    num_experts_per_tok = 2
    hidden_size = HIDDEN
    intermediate_size = FFN


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) * 0.3)


class _Block(torch.nn.Module):
    """A Mixtral sparse block: softmax router, top-2 renormalised, SiLU-gated experts."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = _Experts()
        self.top_k = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        scores, chosen = torch.softmax(self.gate(tokens), dim=-1).topk(self.top_k, dim=-1)
        scores = scores / scores.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(EXPERTS):
            rows, k = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                gate, up = (tokens[rows] @ self.experts.gate_up_proj[e].t()).chunk(2, dim=-1)
                y = (torch.nn.functional.silu(gate) * up) @ self.experts.down_proj[e].t()
                out = out.index_add(0, rows, y * scores[rows, k].unsqueeze(-1))
        return out.reshape(x.shape)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4321)
        self.config = _Config()
        self.inp = torch.nn.Linear(6, HIDDEN)
        self.model = torch.nn.Module()  # the preset finds blocks at model.layers.<i>.mlp
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = _Block()
        self.out = torch.nn.Linear(HIDDEN, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).unsqueeze(0)  # [batch 1, sequence, hidden], as AutoEP's blocks take
        return self.out(h + self.model.layers[0].mlp(h)).squeeze(0)


def config(stage: int, world: int, ep_size: int, checkpoint: dict | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "expert_parallel": {"enabled": True, "autoep_size": ep_size, "preset_model": "mixtral",
                            "use_grouped_mm": False},
    }
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def run(deepspeed: Any, rank: int, world: int, stage: int, first: int, steps: int, ep_size: int = 2,
        load: str | None = None, save: str | None = None, save_at: int | None = None,
        checkpoint: dict | None = None, load_kwargs: dict | None = None) -> dict[str, Any]:
    """Train steps ``first``..``first + steps - 1``; load ``load`` before, save into ``save``
    before step ``save_at``. Returns this rank's losses and the names of the converted module's
    state dict (``keys``)."""
    engine, _, _, _ = deepspeed.initialize(model=Net(), config=config(stage, world, ep_size, checkpoint))
    out: dict[str, Any] = {"losses": []}
    if load is not None:
        engine.load_checkpoint(load, **(load_kwargs or {}))
        out["global_steps"] = engine.global_steps
    for step in range(first, first + steps):
        if save is not None and step == save_at:
            engine.save_checkpoint(save, client_state={"note": "autoep"})
        x, y = deepspeed_job.batch(step, rank, world)  # the dense job's batches
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    return out


if __name__ == "__main__":
    deepspeed_job.main(run)
