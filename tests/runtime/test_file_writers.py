"""DeepNVMe's file writers (``deepspeed.io``): ``torch.save`` into each writes the bytes a plain
file gets, ``torch.load`` reads them back, and a save that fails leaves the old file intact."""

from __future__ import annotations

import io
import os

import pytest
import torch

from dslaunch.io import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter

STATE = {"w": torch.arange(3000, dtype=torch.float32).view(30, 100), "b": torch.ones(7, dtype=torch.bfloat16),
         "step": 5, "names": ["a", "b"]}


def _plain(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _fast(path, staged: int = 1000) -> FastFileWriter:
    config = FastFileWriterConfig(dnvme_handle=None, pinned_tensor=torch.zeros(staged, dtype=torch.uint8))
    return FastFileWriter(file_path=str(path), config=config)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [PyFileWriter, _fast], ids=["py", "fast"])
def test_torch_save_writes_the_plain_bytes(tmp_path, make) -> None:
    path = tmp_path / "ckpt.pt"
    writer = make(path)
    torch.save(obj=STATE, f=writer)
    assert not path.exists()  # nothing under the name before close()
    writer.close()
    assert path.read_bytes() == _plain(STATE)
    loaded = torch.load(path)
    assert torch.equal(loaded["w"], STATE["w"]) and torch.equal(loaded["b"], STATE["b"]) and loaded["step"] == 5
    stats = writer.file_stats()
    assert stats["bytes"] == path.stat().st_size and stats["close"] == 1 and stats["path"] == str(path)
    assert [f for f in os.listdir(tmp_path) if f != "ckpt.pt"] == []  # no temporary file left


@pytest.mark.timeout(30)
def test_fast_writer_stages_through_the_buffer(tmp_path) -> None:
    writer = _fast(tmp_path / "x.pt", staged=1000)
    torch.save(STATE, writer)
    writer.close()
    stats = writer.file_stats()
    assert stats["aio_bytes"] == stats["bytes"] and stats["fill_buffer_count"] >= stats["bytes"] // 1000
    with pytest.raises(ValueError, match="pinned_tensor"):
        FastFileWriter(tmp_path / "y.pt", FastFileWriterConfig(None, torch.zeros(4)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make", [PyFileWriter, _fast], ids=["py", "fast"])
def test_a_failed_save_leaves_the_old_file(tmp_path, make) -> None:
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"old checkpoint")

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom mid-write")

    with pytest.raises(RuntimeError, match="boom"), make(path) as writer:
        torch.save({"w": STATE["w"], "bad": Unpicklable()}, writer)
    assert path.read_bytes() == b"old checkpoint"
    dropped = make(path)  # never closed: collected, its temporary file goes
    torch.save(STATE, dropped)
    del dropped
    assert path.read_bytes() == b"old checkpoint"
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.timeout(30)
def test_mock_writer_counts_and_writes_nothing(tmp_path) -> None:
    writer = MockFileWriter(tmp_path / "m.pt")
    torch.save(STATE, writer)
    writer.close()
    assert writer.file_stats()["bytes"] == len(_plain(STATE))
    assert (tmp_path / "m.pt").read_bytes() == b""
