"""Run by real DeepSpeed's interpreter: ``python ds_reference.py OUT``. Writes under OUT what
DeepSpeed 0.19.8 makes of ``reference_data``: an indexed dataset (``indexed``), the analyzer's files
(``analysis``), and for each curriculum case the sampler's micro batches (``batches.json``) and its
cluster files (``clusters_<case>``)."""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_data as ref  # noqa: E402
from deepspeed.runtime.data_pipeline.config import get_data_efficiency_config  # noqa: E402
from deepspeed.runtime.data_pipeline.data_sampling import data_sampler  # noqa: E402
from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer  # noqa: E402
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler  # noqa: E402
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDatasetBuilder  # noqa: E402

STEPS = 30


def main(out: str) -> None:
    builder = MMapIndexedDatasetBuilder(f"{out}/indexed.bin", dtype=np.int16)
    for i, item in enumerate(ref.indexed_items()):
        builder.add_item(torch.from_numpy(item))
        if i % 2:
            builder.end_document()
    builder.finalize(f"{out}/indexed.idx")
    analysis = f"{out}/analysis"
    analyzer = DataAnalyzer(ref.TokenDataset(), **ref.analyzer_kwargs(analysis, threads=2, reduce=2))
    analyzer.run_map()
    analyzer.run_reduce()
    # torch.distributed itself: deepspeed.comm on CPU would first build its shared-memory op (minutes)
    data_sampler.dist = torch.distributed
    torch.distributed.init_process_group("gloo")
    group = torch.distributed.new_group([0])
    batches = {}
    for case in ("value", "percentile", "both"):
        config = get_data_efficiency_config({"data_efficiency": ref.data_efficiency(analysis, f"{out}/clusters_{case}", case)})
        sampler = DeepSpeedDataSampler(config, ref.SAMPLES, 4, 0, 1, group, 2, 0, drop_last=True)
        it = iter(sampler)
        batches[case] = [[int(i) for i in next(it)] for _ in range(STEPS * 2)]
    with open(f"{out}/batches.json", "w") as f:
        json.dump(batches, f)
    with open(f"{out}/random_ltd.json", "w") as f:
        json.dump(random_ltd(), f)
    with open(f"{out}/variable_batch.json", "w") as f:
        json.dump(variable_batch(), f, default=int)  # numpy ints in the lengths


def variable_batch() -> dict:
    from deepspeed.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vb

    out = {}
    for name, kwargs in ref.VARIABLE_CASES.items():
        out[name] = vb.batch_by_seqlens(ref.lengths(), **kwargs)
    for name, (method, use_scheduler) in ref.LR_CASES.items():
        out[name] = ref.lr_run(vb, method, use_scheduler)
    return out


class _SortOnly:
    """DeepSpeed's CUDA op stands in by its one CPU-meaningful call: each row's indices sorted."""

    @staticmethod
    def token_sort_(indices, seq_length):
        return indices.sort(dim=-1).values


def random_ltd() -> dict:
    from deepspeed.ops.random_ltd import dropping_utils
    from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

    dropping_utils.random_ltd_module = _SortOnly()
    torch.manual_seed(ref.LTD_SEED)
    gpt, _ = dropping_utils.gpt_sample_tokens(5, 12, 3, 2, "cpu", None)
    mask = ref.ltd_mask()
    bert, masks = dropping_utils.bert_sample_tokens(4, 6, 2, 2, "cpu", mask)
    scheduler = RandomLTDScheduler(ref.ltd_block())
    schedule = []
    for step in range(14):
        scheduler.update_seq(step)
        schedule.append([scheduler.get_current_seq(), scheduler.state["consumed_layer_tokens"]])
    return {"gpt": gpt.tolist(), "bert": bert.tolist(), "bert_masks": [m.tolist() for m in masks],
            "schedule": schedule, "state": scheduler.state_dict()}


if __name__ == "__main__":
    main(sys.argv[1])
