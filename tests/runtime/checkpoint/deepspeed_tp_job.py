"""One AutoTP training job (``tensor_parallel.autotp_size``) that real DeepSpeed and dslaunch both
run, for the checkpoint interop tests of DeepSpeed's tensor-parallel layout (``mp_rank_TT_...``).

As a script (``python deepspeed_tp_job.py OUT ARGS_JSON``, one process per rank with RANK/
WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) it runs under whichever ``deepspeed`` the interpreter
imports (real DeepSpeed's AutoTP imports ``transformers``). ``run(deepspeed, ...)`` is the same job
for dslaunch (``run_world``).

The job: a tiny decoder named as Hugging Face's Llama (``q_proj`` ... ``down_proj``: DeepSpeed's
AutoTP finds its layers by these names), AdamW from the config, ZeRO-1, and a fixed global batch
of 4 sequences per step split over the data-parallel replicas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

HIDDEN, HEADS, INNER, VOCAB, SEQ, GLOBAL_BATCH = 16, 4, 24, 32, 6, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = HIDDEN // HEADS
        q, k, v = (p(x).view(b, t, -1, d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.softmax(q @ k.transpose(-1, -2) / d ** 0.5, -1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(HIDDEN, INNER), nn.Linear(HIDDEN, INNER), \
            nn.Linear(INNER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn, self.mlp = nn.LayerNorm(HIDDEN), Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(x)


class TinyLlamaModel(nn.Module):
    """DeepSpeed's AutoTP wants ``Model`` in the class name (its policy lookup)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm, self.lm_head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # the name dslaunch's planner passes
        ids = input_ids
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def config(tp: int, dp: int, stage: int, checkpoint: dict | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp}, "steps_per_print": 10**9,
        "gradient_clipping": 0.0,
    }
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def batch(step: int, dp: int, replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    n = GLOBAL_BATCH // dp
    return ids[replica * n:(replica + 1) * n]


def full_state(deepspeed: Any, engine: Any) -> dict[str, list]:
    """This rank's slice of each parameter: fp32 master and Adam moments (``safe_get_full_*``),
    with its shape."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = [list(p.shape), deepspeed.utils.safe_get_full_fp32_param(p).reshape(-1).tolist()]
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}:{key}"] = deepspeed.utils.safe_get_full_optimizer_state(p, key).reshape(-1).tolist()
    return out


def run(deepspeed: Any, rank: int, world: int, tp: int, first: int, steps: int, stage: int = 1,
        load: str | None = None, save: str | None = None, save_at: int | None = None,
        checkpoint: dict | None = None, probe: bool = True) -> dict[str, Any]:
    """Train steps ``first``..``first + steps - 1``; load ``load`` before, save into ``save`` before
    step ``save_at``. Returns each step's loss averaged over the replicas, what ``load_checkpoint``
    returned, the counters after it and (``probe``) the ``full_state`` after loading or at the save
    (DeepSpeed's ``safe_get_full_*`` fail before its first step after a load and at ZeRO-0: no
    probe there)."""
    torch.manual_seed(1234)
    dp = world // tp
    engine, _, _, _ = deepspeed.initialize(model=TinyLlamaModel(), config=config(tp, dp, stage, checkpoint))
    replica = rank // tp  # tensor ranks are neighbours (DeepSpeed's and dslaunch's default)
    out: dict[str, Any] = {"losses": []}
    if load is not None:
        path, client = engine.load_checkpoint(load)
        out.update(path=path, global_steps=engine.global_steps,
                   client={k: v for k, v in (client or {}).items() if isinstance(v, (int, str, float))})
        if probe:
            out["state"] = full_state(deepspeed, engine)
    for step in range(first, first + steps):
        if save is not None and step == save_at:
            engine.save_checkpoint(save, client_state={"note": "from the job", "step": step})
            if probe:
                out["state"] = full_state(deepspeed, engine)
        loss = engine(batch(step, dp, replica))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        out["losses"].append(mean.item() / world)  # the tensor ranks of a replica hold the same loss
    return out


if __name__ == "__main__":  # run as a script: its folder is on the path
    import deepspeed_job

    deepspeed_job.main(run)
