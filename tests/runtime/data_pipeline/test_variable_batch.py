"""Batching by a token budget and the LR scaled per batch: DeepSpeed 0.19.8's batches, rank share
and LRs for the same lengths (``ds_reference.py``), the token budget kept, and the engine entry
point reading ``data_efficiency.data_sampling.dynamic_batching`` (lengths from the analyzer's files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vb
from tests.runtime.data_pipeline import reference_data as ref


def _plain(value: object) -> object:
    return json.loads(json.dumps(value, default=int))


@pytest.mark.timeout(200)
def test_batches_shares_and_lrs_are_deepspeeds(deepspeed_out: Path) -> None:
    expected = json.loads((deepspeed_out / "variable_batch.json").read_text())
    for name, kwargs in ref.VARIABLE_CASES.items():
        assert _plain(vb.batch_by_seqlens(ref.lengths(), **kwargs)) == expected[name], name
    for name, (method, use_scheduler) in ref.LR_CASES.items():
        got = ref.lr_run(vb, method, use_scheduler)
        assert got["rank1"] == expected[name]["rank1"]
        assert got["lrs"] == pytest.approx(expected[name]["lrs"], rel=1e-12)


@pytest.mark.timeout(30)
def test_micro_batches_keep_the_budget_and_batch_sizes_add_up() -> None:
    lengths = ref.lengths()
    micro, sizes, longest = vb.batch_by_seqlens(lengths, 100, effective_batch_size=4, max_batch_size=3)
    assert all(sum(lengths[i] for i in ids) <= 100 and len(ids) <= 3 for _, ids in micro)
    assert sizes == [sum(len(ids) for b, ids in micro if b == k) for k in range(len(sizes))]
    assert longest[0] == max(lengths[i] for b, ids in micro if b == 0 for i in ids)
    assert vb.scale_lr(8, 2, 1.0, "sqrt") == 0.5 and vb.scale_lr(8, 2, 1.0, "none") == 1.0
    with pytest.raises(UsageError, match="fewer than the 300 of one batch"):
        vb.batch_by_seqlens(lengths, 100, effective_batch_size=300)
    with pytest.raises(ValueError, match="Unknown scaling method"):
        vb.scale_lr(8, 2, 1.0, "cubic")


@pytest.mark.timeout(60)
def test_engine_entry_point_reads_the_config_and_the_analyzer_files(tmp_path: Path) -> None:
    import dslaunch

    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "data_efficiency": {"seed": 5, "data_sampling": {"dynamic_batching": {
                  "enabled": True, "max_tokens": 80, "metrics_path": str(tmp_path / "metrics"),
                  "sequence_picking_order": "seqlen", "lr_scaling_method": "linear"}}}}
    engine, *_ = dslaunch.initialize(model=torch.nn.Linear(2, 2), config=config)
    loader, scheduler, kwargs = vb.get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        ref.TokenDataset(), engine, dataloader_collate_fn=ref.collate,
        batch_seqlens_fn=lambda batch: [int(s["length"]) for s in batch])  # the analyzer runs first
    assert (tmp_path / "metrics/seqlen/seqlen_sample_to_metric.idx").exists()
    first = next(iter(loader))
    assert sum(int(s["length"]) for s in first) <= 80 and kwargs["batch_size"] == 1
    assert scheduler.get_lr()[0] == pytest.approx(0.1 * scheduler.batch_sizes[0] / 2)
    with pytest.raises(ConfigError, match="dynamic_batching.max_tokens"):
        dslaunch.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 2, "data_efficiency": {
            "data_sampling": {"dynamic_batching": {"enabled": True}}}})
