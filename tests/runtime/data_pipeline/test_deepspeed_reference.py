"""dslaunch's data-efficiency files and batches against real DeepSpeed 0.19.8's on CPU.

``ds_reference.py`` runs in DeepSpeed's venv (``.venv-conformance/deepspeed`` or the interpreter
``DSLAUNCH_DEEPSPEED_PYTHON`` names; without one these tests skip and say why) and writes what
DeepSpeed makes of ``reference_data``: an int16 indexed dataset with empty items and documents,
the DataAnalyzer's files (2 map threads, 2 reduce chunks: a length metric and an accumulated
vocabulary histogram), and, for three curricula (by value, by percentile, two metrics at once), the
first 60 micro batches its ``DeepSpeedDataSampler`` hands out and its cluster files. dslaunch must
make the same bytes in every file, read DeepSpeed's files, and draw the same batches in the same
order from DeepSpeed's index files.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dslaunch.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from dslaunch.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
)
from tests.runtime.data_pipeline import reference_data as ref

CASES = ("value", "percentile", "both")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.timeout(200)
def test_indexed_dataset_bytes_and_reading_match_deepspeed(deepspeed_out: Path, tmp_path: Path) -> None:
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "indexed.bin"), dtype=np.int16)
    for i, item in enumerate(ref.indexed_items()):
        builder.add_item(torch.from_numpy(item))
        if i % 2:
            builder.end_document()
    builder.finalize(str(tmp_path / "indexed.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"indexed.{ext}").read_bytes() == (deepspeed_out / f"indexed.{ext}").read_bytes()
    theirs = MMapIndexedDataset(str(deepspeed_out / "indexed"))
    assert [list(theirs[i]) for i in range(len(theirs))] == [list(x.astype(np.int16)) for x in ref.indexed_items()]
    assert list(theirs.doc_idx) == [0, 2, 4] and theirs.dtype == np.int16


@pytest.mark.timeout(200)
def test_data_analyzer_writes_deepspeeds_files(deepspeed_out: Path, tmp_path: Path) -> None:
    analyzer = DataAnalyzer(ref.TokenDataset(), **ref.analyzer_kwargs(str(tmp_path / "analysis"), threads=2, reduce=2))
    analyzer.run_map()
    analyzer.run_reduce()
    ours, theirs = _tree(tmp_path / "analysis"), _tree(deepspeed_out / "analysis")
    assert sorted(ours) == sorted(theirs)
    assert [name for name in ours if ours[name] != theirs[name]] == []
    to_metric = MMapIndexedDataset(str(tmp_path / "analysis/seqlen/seqlen_sample_to_metric"))
    assert [int(to_metric[i][0]) for i in range(ref.SAMPLES)] == ref.lengths()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
def test_sampler_draws_deepspeeds_batches_and_clusters(deepspeed_out: Path, tmp_path: Path, case: str) -> None:
    expected = json.loads((deepspeed_out / "batches.json").read_text())[case]
    config = ref.data_efficiency(str(deepspeed_out / "analysis"), str(tmp_path / "clusters"), case)
    batches = iter(DeepSpeedDataSampler(config, ref.SAMPLES, 4, 0, 1, None, 2, 0))
    assert [next(batches) for _ in range(len(expected))] == expected
    assert _tree(tmp_path / "clusters") == _tree(deepspeed_out / f"clusters_{case}")
