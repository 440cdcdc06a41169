"""Checkpoint sources for ``init_inference``: slices read from safetensors and torch files equal
the slices of the full tensors; bad checkpoints are one line; a plain model fills from its file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import dslaunch
from dslaunch.errors import CheckpointError, UsageError
from dslaunch.inference import empty_init
from dslaunch.runtime.inference.loading import open_checkpoint
from tests.inference.models import tiny_lm

SEGMENTS = ((1, 3), (5, 6))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_slices_come_from_the_file_as_from_the_tensor(tmp_path: Path, suffix: str) -> None:
    tensors = {"w": torch.arange(56, dtype=torch.float32).view(7, 8), "b": torch.arange(7.0)}
    path = tmp_path / f"weights{suffix}"
    save_file(tensors, str(path)) if suffix == ".safetensors" else torch.save(tensors, path)
    source = open_checkpoint(str(path))
    assert source.names() == {"w", "b"}
    for dim in (0, 1):
        want = torch.cat([tensors["w"].narrow(dim, a, b - a) for a, b in SEGMENTS], dim=dim)
        assert torch.equal(source.read("w", dim, SEGMENTS), want)
    assert torch.equal(source.read("b"), tensors["b"])


def test_bad_checkpoints_are_one_line(tmp_path: Path) -> None:
    cases = [(str(tmp_path / "missing"), CheckpointError, "does not exist"),
             ({"type": "Megatron", "checkpoints": ["a.pt"]}, UsageError, "per-rank"),
             ({"type": "ds_model"}, UsageError, "'checkpoints'"),
             ({"type": "ds_model", "checkpoints": ["nope.pt"]}, CheckpointError, "does not exist"),
             (str(tmp_path), CheckpointError, "holds no weights")]
    for spec, error, words in cases:
        with pytest.raises(error, match=words) as err:
            open_checkpoint(spec, base_dir=str(tmp_path) if isinstance(spec, dict) else None)
        assert "\n" not in str(err.value)


def test_meta_model_fills_from_a_description_and_names_a_missing_tensor(tmp_path: Path) -> None:
    reference = tiny_lm()
    state = reference.state_dict()
    torch.save(state, tmp_path / "full.pt")
    (tmp_path / "ds.json").write_text(json.dumps({"type": "ds_model", "checkpoints": ["full.pt"], "version": 1.0}))
    with empty_init():
        model = type(reference)()
    engine = dslaunch.init_inference(model.eval(), checkpoint=str(tmp_path / "ds.json"), dtype="bf16")
    ids = torch.tensor([[1, 2, 3]])
    assert engine.module.head.weight.dtype is torch.bfloat16
    assert torch.allclose(engine(ids).float(), reference(ids), atol=0.1)
    del state["norm.weight"]
    torch.save(state, tmp_path / "partial.pt")
    with empty_init():
        model = type(reference)()
    with pytest.raises(UsageError, match="no tensor for 'norm.weight'"):
        dslaunch.init_inference(model, checkpoint=str(tmp_path / "partial.pt"))


@pytest.mark.timeout(60)
def test_input_files_are_bounded_before_they_are_parsed(tmp_path: Path) -> None:
    """A FIFO, /dev/zero, a 1 GB file and a directory where a description, an index or a weights
    file is expected: one line naming it, at once (no read of a GB, no block on a FIFO)."""
    fifo, big = tmp_path / "desc.json", tmp_path / "big.json"
    import os

    os.mkfifo(fifo)
    with open(big, "wb") as f:
        f.truncate(2**30)
    (tmp_path / "folder.safetensors").mkdir()
    cases = [(str(fifo), "not a regular file"), (str(big), "larger than 64 MiB"), ("/dev/zero", "not a regular file"),
             ({"type": "ds_model", "checkpoints": ["folder.safetensors"]}, "is a directory"),
             ({"type": "ds_model", "checkpoints": ["/dev/zero"]}, "not a regular file")]
    for spec, words in cases:
        with pytest.raises(CheckpointError, match=words) as err:
            open_checkpoint(spec, base_dir=str(tmp_path) if isinstance(spec, dict) else None)
        named = spec if isinstance(spec, str) else spec["checkpoints"][0]
        assert "\n" not in str(err.value) and named in str(err.value), err.value
    (tmp_path / "bad.index.json").write_text('{"weight_map": {"w": ')
    with pytest.raises(CheckpointError, match=r"bad.index.json: line 1: not valid JSON"):
        open_checkpoint(str(tmp_path / "bad.index.json"))


@pytest.mark.parametrize(("what", "data", "words"), [
    ("empty", b"", "header length"),
    ("huge length", (2**40).to_bytes(8, "little") + b"{}", "header length"),
    ("not JSON", (4).to_bytes(8, "little") + b"\xff\xfe{]", "not a JSON object"),
    ("a list", (2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    ("bad entry", (25).to_bytes(8, "little") + b'{"w": {"dtype": "F32"}}  ', "SafetensorError"),
])
def test_a_corrupt_safetensors_file_is_named(tmp_path: Path, what: str, data: bytes, words: str) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=words) as err:
        open_checkpoint(str(path))
    assert str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value), err.value
