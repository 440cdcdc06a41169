"""AutoSP on a tiny Hugging Face ViT (built from a ``ViTConfig``, no download) under
``deepspeed.initialize`` with ``sequence_parallel_size`` 2: 25 patches and a [CLS] token, split
13/12 over the two ranks after the embeddings. Each rank also runs the unwrapped model on the
whole sequence in-process (the reference). Rank 0 prints ``RESULTS {json}``: the largest
differences over both ranks of the output rows, the parameter gradients (``safe_get_full_grad``,
averaged by the engine), the pixel gradient (summed over the ranks) and the parameters after one
SGD step, and the size of the reference gradients.

Usage: dslaunch --num_gpus 2 hf_vit_autosp.py STAGE
"""

from __future__ import annotations

import copy
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
import transformers as T
from deepspeed.sequence.auto_sp import auto_wrap_model_for_sp
from deepspeed.utils import groups, safe_get_full_grad

LR, BATCH = 0.1, 2


class Tower(torch.nn.Module):
    """The ViT's embeddings, layers and final norm; with ``sp`` (rank, ranks) the layers get this
    rank's rows: the [CLS] token and its contiguous share of the patches."""

    def __init__(self) -> None:
        super().__init__()
        config = T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             image_size=20, patch_size=4, num_channels=3, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
        config._attn_implementation = "sdpa"
        self.vit = T.ViTModel(config, add_pooling_layer=False)
        self.sp: tuple[int, int] | None = None

    def rows(self, total: int) -> list[int]:
        if self.sp is None:
            return list(range(total))
        rank, ranks = self.sp
        base, extra = divmod(total - 1, ranks)
        start = 1 + rank * base + min(rank, extra)
        return [0, *range(start, start + base + (rank < extra))]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.vit.embeddings(pixel_values)
        hidden = hidden[:, self.rows(hidden.shape[1])]
        for layer in self.vit.layers:
            hidden = layer(hidden, None)
        return self.vit.layernorm(hidden)


def main(stage: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    tower = Tower()
    reference = copy.deepcopy(tower)
    pixels = torch.randn(BATCH, 3, 20, 20)
    weight = torch.randn(BATCH, 26, 32)  # the loss: sum(output * weight) over the whole sequence

    ref_pixels = pixels.clone().requires_grad_()
    ref_out = reference(ref_pixels)
    (ref_out * weight).sum().backward()
    ref_grads = [p.grad for p in reference.parameters()]

    config = {"train_micro_batch_size_per_gpu": BATCH, "sequence_parallel_size": 2, "steps_per_print": 1000,
              "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": LR}}}
    engine, _, _, _ = deepspeed.initialize(model=tower, config=config)
    group = groups._get_sequence_parallel_group()
    auto_wrap_model_for_sp(engine, group)  # DeepSpeed's usage: after initialize, on the engine
    wrapped = sum(type(m).__name__ == "UlyssesSPViTAttention" for m in engine.modules())
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    tower.sp = (rank, ranks)
    rows = tower.rows(26)

    my_pixels = pixels.clone().requires_grad_()
    out = engine(my_pixels)
    # each rank's share of the loss, the [CLS] row counted once over the group; times the ranks,
    # as the engine averages the gradients over them
    share = torch.tensor([1 / ranks] + [1.0] * (len(rows) - 1)).view(1, -1, 1)
    engine.backward((out * weight[:, rows] * share).sum() * ranks)
    grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
    pixel_grad = my_pixels.grad / ranks
    dist.all_reduce(pixel_grad, group=group)
    engine.step()
    after = [p.detach().clone() for p in engine.module.parameters()]
    with torch.no_grad():
        stepped = [p - LR * g for p, g in zip(reference.parameters(), ref_grads, strict=True)]

    def worst(pairs) -> float:
        return max(float((a - b).abs().max()) for a, b in pairs)

    errors = torch.tensor([float((out.detach() - ref_out[:, rows]).abs().max()), worst(zip(grads, ref_grads, strict=True)),
                           float((pixel_grad - ref_pixels.grad).abs().max()), worst(zip(after, stepped, strict=True))])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX)
    results = dict(zip(("out", "grads", "pixel_grad", "after_step"), errors.tolist(), strict=True))
    results.update(wrapped=wrapped, rows=len(rows), scale=max(float(g.abs().max()) for g in ref_grads),
                   pixel_scale=float(ref_pixels.grad.abs().max()))
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(int(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
