"""A script shaped like DeepSpeed's pipeline example (DeepSpeedExamples training/pipeline_parallelism),
in our words, for machines without that checkout: ``add_config_arguments``, ``init_distributed``
with the script's backend, ``deepspeed.runtime.utils.set_random_seed`` reached as an attribute of a
bare ``import deepspeed``, a ``PipelineModule`` made of a conv net's layers (a lambda among them)
partitioned by parameters, ``initialize(training_data=...)`` and ``train_batch``; ``-p 0`` trains the
plain engine through ``deepspeed.utils.RepeatingLoader``. Rank 0 prints ``LOSSES <json>``.
"""

import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pipeline")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=3)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--backend", type=str, default="gloo")
    parser.add_argument("--seed", type=int, default=1138)
    return deepspeed.add_config_arguments(parser).parse_args()


def images() -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 16, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 0).long())


def layers() -> list:
    return [torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
            lambda x: torch.flatten(x, 1), torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)]


def main() -> None:
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    deepspeed.runtime.utils.set_random_seed(args.seed)
    losses = []
    if args.pipeline_parallel_size == 0:
        net = torch.nn.Sequential(*(m if isinstance(m, torch.nn.Module) else torch.nn.Flatten() for m in layers()))
        engine, _, loader, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                                                    training_data=images())
        data = iter(RepeatingLoader(loader))
        criterion = torch.nn.CrossEntropyLoss()
        for _ in range(args.steps * engine.gradient_accumulation_steps()):
            inputs, labels = next(data)
            loss = criterion(engine(inputs.to(engine.device)), labels.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    else:
        net = PipelineModule(layers=layers(), loss_fn=torch.nn.CrossEntropyLoss(),
                             num_stages=args.pipeline_parallel_size, partition_method="parameters",
                             activation_checkpoint_interval=0)
        engine, _, _, _ = deepspeed.initialize(args=args, model=net, training_data=images(),
                                               model_parameters=[p for p in net.parameters() if p.requires_grad])
        losses = [engine.train_batch().item() for _ in range(args.steps)]
    if dist.get_rank() == 0:
        print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
