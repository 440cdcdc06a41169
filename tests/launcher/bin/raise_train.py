"""A training job (pipeline or ZeRO) in which one rank raises inside its model's forward.

Environment: ``STAGES`` (pipeline stages; 0: a plain model under ZeRO stage ``ZERO``, default 2),
``FAIL_RANK`` (the rank that raises), ``FAIL_AT`` (at its n-th forward of a micro batch, default 5:
mid-training), ``STEPS`` (default 6). The other ranks then fail for lack of it: pipeline stages on
the stop the failing stage sends them, ZeRO ranks in their gradient all-reduce.
"""

import os

import torch

import dslaunch
from dslaunch.pipe import LayerSpec, PipelineModule

STAGES = int(os.environ.get("STAGES", "2"))
FAIL_RANK, FAIL_AT = int(os.environ["FAIL_RANK"]), int(os.environ.get("FAIL_AT", "5"))
RANK = int(os.environ["RANK"])
_forwards = [0]


class Bomb(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _forwards[0] += 1
        if RANK == FAIL_RANK and _forwards[0] == FAIL_AT:
            raise ValueError(f"rank {RANK} broke at forward {FAIL_AT}")
        return x.tanh()


dslaunch.init_distributed(verbose=False)
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 10**9,
       "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
g = torch.Generator().manual_seed(RANK)
if STAGES:
    layers = [LayerSpec(torch.nn.Linear, 8, 8) if i % 2 == 0 else LayerSpec(Bomb) for i in range(2 * STAGES)]
    module = PipelineModule(layers, num_stages=STAGES, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="type:linear")
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    data = iter(lambda: (lambda x: (x, x.tanh()))(torch.randn(2, 8, generator=g)), None)
    for _ in range(int(os.environ.get("STEPS", "6"))):
        engine.train_batch(data)
else:
    cfg["zero_optimization"] = {"stage": int(os.environ.get("ZERO", "2"))}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Bomb(), torch.nn.Linear(8, 8))
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(int(os.environ.get("STEPS", "6")) * 2):
        x = torch.randn(2, 8, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x), x.tanh()))
        engine.step()
