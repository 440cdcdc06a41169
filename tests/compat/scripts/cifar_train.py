"""A script shaped like DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples training/cifar):
``get_accelerator`` imported on its first lines, ``init_distributed`` with the rank-0-first barrier
around the data set, ``initialize(args=..., model_parameters=..., training_data=...)`` with the
tutorial's ds_config (``--deepspeed_config cifar_ds_config.json``: bf16 with fp16's loss-scaling
keys, ZeRO 0), inputs moved to ``get_accelerator().device_name(local_rank)``, and the example's
top-level ``deepspeed.moe.utils`` import: ``--moe-param-group`` splits the parameters with it,
``--moe`` puts the example's MoE layer (``deepspeed.moe.layer.MoE`` of copies of an 84 x 84 Linear,
its flags ``--ep-world-size``, ``--num-experts``, ``--top-k``, ``--noisy-gate-policy``) between
``fc2`` and the head. Synthetic images instead of the download. Rank 0 prints `bf16=True`, then
`LOSSES <json>` and `STEPS <n>`; with ``--moe`` every rank prints `EXPERTS <sum of its experts' fp32 weights>`.
"""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import safe_get_full_fp32_param


def add_argument() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--moe-param-group", action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", default=2, type=int)
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--noisy-gate-policy", default=None, type=str)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


deepspeed.init_distributed()

if torch.distributed.get_rank() != 0:
    torch.distributed.barrier()  # the tutorial lets rank 0 download first
images = torch.randn(256, 3, 32, 32, generator=torch.Generator().manual_seed(0))
trainset = torch.utils.data.TensorDataset(images, (images.mean(dim=(1, 2, 3)) > 0).long())
if torch.distributed.get_rank() == 0:
    torch.distributed.barrier()


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = None
        if args.moe:  # as the example: experts copy an 84 x 84 Linear, a head after them
            self.moe = deepspeed.moe.layer.MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=args.num_experts,
                                               ep_size=args.ep_world_size, k=args.top_k,
                                               noisy_gate_policy=args.noisy_gate_policy)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc2(F.relu(self.fc1(x))))
        if self.moe is not None:
            x, _, _ = self.moe(x)
        return self.fc3(x)


args = add_argument()
torch.manual_seed(0)
net = Net(args)
parameters = filter(lambda p: p.requires_grad, net.parameters())
if args.moe_param_group:
    parameters = split_params_into_different_moe_groups_for_optimizer({"params": list(parameters), "name": "p"})
model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=trainset)

local_device = get_accelerator().device_name(model_engine.local_rank)
local_rank = model_engine.local_rank
bf16 = model_engine.bfloat16_enabled()
if local_rank == 0:
    print(f"bf16={bf16}", flush=True)

criterion = nn.CrossEntropyLoss()
losses = []
for i, data in enumerate(trainloader):
    inputs, labels = data[0].to(local_device), data[1].to(local_device)
    if bf16:
        inputs = inputs.to(torch.bfloat16)
    outputs = model_engine(inputs)
    loss = criterion(outputs, labels)
    model_engine.backward(loss)
    model_engine.step()
    losses.append(loss.item())
    if i + 1 == args.steps:
        break
if local_rank == 0:
    print("LOSSES " + json.dumps(losses), flush=True)
    print(f"STEPS {model_engine.global_steps}", flush=True)
if net.moe is not None:  # the fp32 master weights: a few small steps may not move the bf16 copy
    experts = net.moe.deepspeed_moe.experts.parameters()
    print("EXPERTS " + json.dumps(sum(safe_get_full_fp32_param(p).sum().item() for p in experts)), flush=True)
