"""The memory-mapped indexed dataset: what is written reads back (items, slices, parts, documents,
every dtype), the index's layout is the documented one, and bad files are one line naming them."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dslaunch.errors import NotInDslaunchError
from dslaunch.runtime.data_pipeline.data_sampling.indexed_dataset import (
    DTYPES,
    DatasetFormatError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    infer_dataset_impl,
    make_builder,
    make_dataset,
)
from dslaunch.runtime.data_pipeline.data_sampling.utils import find_fit_int_dtype, split_index


def _build(prefix: Path, items: list[np.ndarray], dtype: object, docs_every: int = 0) -> None:
    builder = MMapIndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i, item in enumerate(items):
        builder.add_item(torch.from_numpy(item))
        if docs_every and (i + 1) % docs_every == 0:
            builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("code", sorted(DTYPES))
def test_every_dtype_round_trips(tmp_path: Path, code: int) -> None:
    dtype = DTYPES[code][0]
    items = [np.arange(n).astype(dtype) for n in (3, 0, 7, 1)]
    _build(tmp_path / "d", items, dtype, docs_every=2)
    ds = MMapIndexedDataset(str(tmp_path / "d"))
    assert len(ds) == 4 and ds.dtype == dtype and list(ds.sizes) == [3, 0, 7, 1]
    assert all(np.array_equal(ds[i], items[i]) for i in range(4))
    assert [list(x) for x in ds[1:3]] == [[], list(items[2])]
    assert list(ds.get(2, offset=2, length=3)) == [2, 3, 4] and list(ds.get(2, offset=5)) == [5, 6]
    assert list(ds.doc_idx) == [0, 2, 4]
    again = pickle.loads(pickle.dumps(ds))  # DataLoader workers re-open it by path
    assert np.array_equal(again[2], items[2])


@pytest.mark.timeout(30)
def test_index_layout(tmp_path: Path) -> None:
    """magic, version, dtype code, counts, int32 sizes, int64 byte offsets, int64 documents."""
    _build(tmp_path / "d", [np.array([1, 2, 3]), np.array([4])], np.int32)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", raw[9:34]) == (1, 4, 2, 1)
    assert np.frombuffer(raw[34:42], np.int32).tolist() == [3, 1]
    assert np.frombuffer(raw[42:58], np.int64).tolist() == [0, 12]
    assert np.frombuffer(raw[58:], np.int64).tolist() == [0]  # no end_document: the first document's start only
    assert (tmp_path / "d.bin").read_bytes() == np.array([1, 2, 3, 4], np.int32).tobytes()


@pytest.mark.timeout(30)
def test_merge_and_add_numpy(tmp_path: Path) -> None:
    _build(tmp_path / "a", [np.array([1, 2]), np.array([3])], np.uint16, docs_every=1)
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.add_item_numpy(np.array([9], dtype=np.int64))
    builder.add_items([np.array([8, 7])])
    builder.end_document()
    builder.merge_file_(str(tmp_path / "a"))
    builder.finalize(str(tmp_path / "m.idx"))
    ds = MMapIndexedDataset(str(tmp_path / "m"), skip_warmup=True)
    assert [list(x) for x in ds[0:4]] == [[9], [8, 7], [1, 2], [3]] and list(ds.doc_idx) == [0, 2, 3, 4]
    wrong = MMapIndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=np.int64)
    with pytest.raises(DatasetFormatError, match="holds uint16, but .* int64"):
        wrong.merge_file_(str(tmp_path / "a"))


@pytest.mark.timeout(30)
def test_bad_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "x.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(DatasetFormatError, match=r"x.idx: not a memory-mapped indexed dataset index"):
        MMapIndexedDataset(str(tmp_path / "x"))
    assert infer_dataset_impl(str(tmp_path / "x")) == "cached"
    with pytest.raises(NotInDslaunchError, match="only 'mmap'"):
        make_dataset(str(tmp_path / "x"), "infer")
    with pytest.raises(DatasetFormatError, match="cannot read the index"):
        MMapIndexedDataset(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not supported"):
        MMapIndexedDatasetBuilder(str(tmp_path / "f.bin"), dtype=np.float32)
    assert make_dataset(str(tmp_path / "missing"), "mmap") is None
    assert make_builder(str(tmp_path / "v.bin"), "mmap", vocab_size=50000)._dtype == np.uint16


@pytest.mark.timeout(30)
def test_writer_never_follows_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "d.bin").symlink_to(victim)
    _build(tmp_path / "d", [np.array([5])], np.int64)
    assert victim.read_text() == "keep" and list(MMapIndexedDataset(str(tmp_path / "d"))[0]) == [5]


def test_helpers() -> None:
    assert find_fit_int_dtype(0, 255) == np.uint8 and find_fit_int_dtype(0, 256) == np.uint16
    assert find_fit_int_dtype(-1, 127) == np.int8 and find_fit_int_dtype(-1, 2**40) == np.int64
    assert split_index(0, 10, 3) == [(0, 3), (3, 6), (6, 10)]
