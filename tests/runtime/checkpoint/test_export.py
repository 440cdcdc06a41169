"""zero-to-fp32 with DeepSpeed's API: signatures, directory/sharded/safetensors output, frozen
parameters, loading into a model, the dslaunch.utils import path and the command line.

Checkpoints here are saved by a single in-process engine; consolidation across world sizes and
stages is covered by tests/runtime/checkpoint/test_save_load.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dslaunch.errors import CheckpointError, UsageError
from dslaunch.runtime.checkpoint import export as z2f

HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


class _Net(torch.nn.Module):
    """A frozen weight, buffers (one of them int64) and trained parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)
        self.frozen.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.frozen(x))).square().mean()


def _net(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Two steps of training, saved with and without frozen parameters."""
    import dslaunch

    root = tmp_path_factory.mktemp("z2f")
    engine, *_ = dslaunch.initialize(model=_net(0), dist_init_required=False, config={
        "train_batch_size": 4, "steps_per_print": 10_000, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    for _ in range(2):
        engine.backward(engine(torch.randn(4, 4)))
        engine.step()
    engine.save_checkpoint(root / "full")
    engine.save_checkpoint(root / "trainable", exclude_frozen_parameters=True)
    expected = {k: v.clone() for k, v in engine.module.state_dict().items()}
    return {"root": root, "engine": engine, "expected": expected}


def _same(state: dict, expected: dict, skip: tuple[str, ...] = ()) -> None:
    assert list(state) == [k for k in expected if k not in skip]
    for k, v in state.items():
        assert v.dtype == (torch.float32 if v.is_floating_point() else expected[k].dtype), k
        assert torch.equal(v, expected[k].to(v.dtype)), k


@pytest.mark.timeout(60)
def test_signatures_are_deepspeeds() -> None:
    def params(fn) -> list[tuple[str, object]]:
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    empty = inspect.Parameter.empty
    assert params(z2f.get_fp32_state_dict_from_zero_checkpoint) == [
        ("checkpoint_dir", empty), ("tag", None), ("exclude_frozen_parameters", False), ("lazy_mode", False)]
    assert params(z2f.convert_zero_checkpoint_to_fp32_state_dict) == [
        ("checkpoint_dir", empty), ("output_dir", empty), ("max_shard_size", "5GB"),
        ("safe_serialization", False), ("tag", None), ("exclude_frozen_parameters", False)]
    assert params(z2f.load_state_dict_from_zero_checkpoint) == [
        ("model", empty), ("checkpoint_dir", empty), ("tag", None)]


@pytest.mark.timeout(60)
def test_state_dict_equals_the_trained_model_lazy_mode_too(saved: dict) -> None:
    _same(z2f.get_fp32_state_dict_from_zero_checkpoint(saved["root"] / "full"), saved["expected"])
    lazy = z2f.get_fp32_state_dict_from_zero_checkpoint(saved["root"] / "full", lazy_mode=True)
    _same({k: v.contiguous() for k, v in lazy.items()}, saved["expected"])  # DeepSpeed's lazy protocol


@pytest.mark.timeout(60)
def test_exclude_frozen_parameters_keeps_buffers(saved: dict, monkeypatch) -> None:
    trainable = z2f.get_fp32_state_dict_from_zero_checkpoint(saved["root"] / "trainable",
                                                             exclude_frozen_parameters=True)
    _same(trainable, saved["expected"], skip=("frozen.weight",))
    # Saved with frozen parameters: the manifest names them, so they can be left out at export.
    _same(z2f.get_fp32_state_dict_from_zero_checkpoint(saved["root"] / "full", exclude_frozen_parameters=True),
          saved["expected"], skip=("frozen.weight",))
    # A checkpoint that does not record them (written before the manifest did): a frozen weight
    # and a buffer look alike in the module file, so this is an error, not a guess.
    manifest = z2f.CheckpointStore.manifest

    def unrecorded(store, tag):
        m = manifest(store, tag)
        del m.meta["frozen_parameters"]
        return m

    monkeypatch.setattr(z2f.CheckpointStore, "manifest", unrecorded)
    with pytest.raises(UsageError, match="global_step2: cannot leave out frozen parameters: this checkpoint "
                                         "does not record which of the tensors"):
        z2f.get_fp32_state_dict_from_zero_checkpoint(saved["root"] / "full", exclude_frozen_parameters=True)


@pytest.mark.timeout(60)
def test_a_directory_gets_deepspeeds_file_name(saved: dict, tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", out) == \
        [out / "pytorch_model.bin"]
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]
    _same(torch.load(out / "pytorch_model.bin"), saved["expected"])


@pytest.mark.timeout(60)
def test_sharded_output_and_its_index(saved: dict, tmp_path: Path) -> None:
    limit = 100  # bytes: frozen.weight (128 B) alone, then groups of at most 100 B
    files = z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", tmp_path,
                                                           max_shard_size=limit)
    n = len(files) - 1
    assert n > 2 and [f.name for f in files] == [f"pytorch_model-{i:05d}-of-{n:05d}.bin"
                                                 for i in range(1, n + 1)] + ["pytorch_model.bin.index.json"]
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    merged = {}
    for f in files[:-1]:
        shard = torch.load(f)
        nbytes = sum(t.numel() * t.element_size() for t in shard.values())
        assert nbytes <= limit or len(shard) == 1, f.name
        assert all(index["weight_map"][k] == f.name for k in shard)
        merged.update(shard)
    assert sorted(index["weight_map"]) == sorted(merged) == sorted(saved["expected"])
    _same({k: merged[k] for k in saved["expected"]}, saved["expected"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    # A later unsharded export into the same directory leaves no stale shard or index behind.
    z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", tmp_path, max_shard_size="5GB")
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_SAFETENSORS, reason="safetensors not installed")
def test_safe_serialization_writes_loadable_safetensors(saved: dict, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", tmp_path, safe_serialization=True)
    path = tmp_path / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses safetensors without it
    loaded = load_file(str(path))
    _same({k: loaded[k] for k in saved["expected"]}, saved["expected"])
    with pytest.raises(UsageError, match="name the file \\*.safetensors"):
        z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", tmp_path / "m.bin",
                                                       safe_serialization=True)


@pytest.mark.timeout(60)
def test_other_dtypes_cast_floats_only(saved: dict, tmp_path: Path) -> None:
    z2f.convert_zero_checkpoint_to_state_dict(saved["root"] / "full", tmp_path / "m.pt", dtype="bf16")
    state = torch.load(tmp_path / "m.pt")
    assert state["head.weight"].dtype == torch.bfloat16
    assert state["norm.num_batches_tracked"].dtype == torch.int64
    with pytest.raises(UsageError, match="expected float32, float16 or bfloat16"):
        z2f.convert_zero_checkpoint_to_state_dict(saved["root"] / "full", tmp_path, dtype="int8")
    for bad in ("5 gigs", 0, True, "-1MB"):
        with pytest.raises(UsageError, match="max_shard_size: expected a size"):
            z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", tmp_path, max_shard_size=bad)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        z2f.convert_zero_checkpoint_to_fp32_state_dict(saved["root"] / "full", tmp_path / "notes.txt")


@pytest.mark.timeout(60)
def test_load_state_dict_from_zero_checkpoint(saved: dict) -> None:
    model = z2f.load_state_dict_from_zero_checkpoint(_net(7), saved["root"] / "full")
    _same(model.state_dict(), saved["expected"])
    # Saved without the frozen weight: the model keeps its own.
    other = _net(7)
    kept = other.frozen.weight.clone()
    z2f.load_state_dict_from_zero_checkpoint(other, saved["root"] / "trainable")
    assert torch.equal(other.frozen.weight, kept) and torch.equal(other.head.weight, saved["expected"]["head.weight"])
    # Another model: an error naming the mismatch, and nothing loaded.
    wrong = torch.nn.Sequential(torch.nn.Linear(4, 2))
    before = wrong[0].weight.clone()
    with pytest.raises(CheckpointError, match=r"does not fit the model: missing \['0.bias', '0.weight'\]"):
        z2f.load_state_dict_from_zero_checkpoint(wrong, saved["root"] / "full")
    assert torch.equal(wrong[0].weight, before)


@pytest.mark.timeout(60)
def test_save_16bit_model_can_exclude_frozen_parameters(saved: dict, tmp_path: Path) -> None:
    assert saved["engine"].save_16bit_model(tmp_path, exclude_frozen_parameters=True)
    exported = torch.load(tmp_path / "pytorch_model.bin")
    assert list(exported) == [k for k in saved["expected"] if k != "frozen.weight"]
    assert "norm.running_mean" in exported  # buffers stay


@pytest.mark.timeout(60)
def test_command_line_directory_shards_and_file(saved: dict, tmp_path: Path, capsys) -> None:
    from dslaunch.launcher.cli import main as cli

    ckpt = str(saved["root"] / "full")
    assert cli(["zero-to-fp32", ckpt, str(tmp_path / "dir"), "--max_shard_size", "0.1KB"]) == 0
    assert (tmp_path / "dir" / "pytorch_model.bin.index.json").is_file()
    assert "files to" in capsys.readouterr().out
    for source in (ckpt, str(saved["root"] / "trainable")):  # saved with and without frozen params
        assert cli(["zero-to-fp32", source, str(tmp_path / "one.pt"), "--exclude_frozen_parameters"]) == 0
        exported = torch.load(tmp_path / "one.pt")
        assert "frozen.weight" not in exported and "norm.running_mean" in exported
    assert cli(["zero-to-fp32", ckpt, str(tmp_path / "one.pt"), "--max_shard_size", "1MB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dslaunch: error: --max_shard_size shards a directory output; {tmp_path / 'one.pt'} names one file"


@pytest.mark.timeout(90)
def test_deepspeed_import_path_and_python_m(saved: dict, tmp_path: Path) -> None:
    import dslaunch as deepspeed
    from dslaunch.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    assert get_fp32_state_dict_from_zero_checkpoint is z2f.get_fp32_state_dict_from_zero_checkpoint
    assert convert_zero_checkpoint_to_fp32_state_dict is z2f.convert_zero_checkpoint_to_fp32_state_dict
    assert load_state_dict_from_zero_checkpoint is z2f.load_state_dict_from_zero_checkpoint
    assert deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint is \
        get_fp32_state_dict_from_zero_checkpoint
    run = [sys.executable, "-m", "dslaunch.utils.zero_to_fp32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([*run, str(saved["root"] / "full"), str(tmp_path)], capture_output=True, text=True,
                        timeout=60, env=env)
    assert ok.returncode == 0 and (tmp_path / "pytorch_model.bin").is_file(), ok.stderr
    bad = subprocess.run([*run, str(tmp_path / "nope"), str(tmp_path)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        f"zero-to-fp32: error: {tmp_path / 'nope'}: not a directory (expected a save_dir or one of its tag "
        "directories)"]


@pytest.mark.timeout(90)
def test_zero_to_torch_writes_the_dtype_asked_for(saved: dict, tmp_path: Path) -> None:
    """DeepSpeed 0.19.8's ``zero_to_torch``: ``--dtype`` required, DeepSpeed's spellings, its ``-d``."""
    from dslaunch.utils import zero_to_torch

    zero_to_torch.main([str(saved["root"] / "full"), str(tmp_path / "bf"), "--dtype", "bf16", "-d"])
    state = torch.load(tmp_path / "bf" / "pytorch_model.bin")
    assert state["head.weight"].dtype == torch.bfloat16 and state["norm.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(state["head.weight"], saved["expected"]["head.weight"].to(torch.bfloat16))
    run = [sys.executable, "-m", "dslaunch.utils.zero_to_torch", str(saved["root"] / "full")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([*run, str(tmp_path / "h"), "--dtype", "float16"], capture_output=True, text=True,
                        timeout=60, env=env)
    assert ok.returncode == 0, ok.stderr
    assert torch.load(tmp_path / "h" / "pytorch_model.bin")["head.weight"].dtype == torch.float16
    missing = subprocess.run([*run, str(tmp_path / "x")], capture_output=True, text=True, timeout=60, env=env)
    assert missing.returncode == 2 and "the following arguments are required: --dtype" in missing.stderr
    bad = subprocess.run([*run, str(tmp_path / "x"), "--dtype", "int8"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert bad.returncode == 2 and "invalid choice: 'int8'" in bad.stderr and not (tmp_path / "x").exists()


def _rewrite_meta(tag_dir: Path, change) -> None:
    """Change a manifest's meta and re-sign it: a manifest that is intact but not an engine's."""
    import zlib

    path = tag_dir / "manifest.json"
    body = json.loads(path.read_text())["body"]
    change(body["meta"])
    text = json.dumps(body, sort_keys=True)
    path.write_text(json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change,problem", [
    (lambda m: m.pop("world_size"), "meta 'world_size' is missing"),
    (lambda m: m.update(world_size="two"), "meta 'world_size' is 'two', expected a whole number"),
    (lambda m: m.update(partition=[1, 2]), "meta 'partition' is missing or malformed"),
    (lambda m: m["partition"]["groups"][0].update(ranges={"0": [5, 1]}), "meta 'partition' group 0 is malformed"),
    (lambda m: m.update(frozen_parameters="frozen.weight"), "meta 'frozen_parameters' is not a list of names"),
])
def test_a_manifest_without_engine_metadata_is_a_one_line_error(saved: dict, tmp_path: Path, change,
                                                                 problem: str) -> None:
    import shutil

    import dslaunch

    root = tmp_path / "ckpt"
    shutil.copytree(saved["root"] / "full", root)
    tag = (root / "latest").read_text()
    _rewrite_meta(root / tag, change)
    expected = f"{root / tag / 'manifest.json'}: not an engine checkpoint this dslaunch version reads: {problem}"
    engine, *_ = dslaunch.initialize(model=_net(1), dist_init_required=False, config={
        "train_batch_size": 4, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    for load in (lambda: engine.load_checkpoint(root, tag=tag),
                 lambda: z2f.get_fp32_state_dict_from_zero_checkpoint(root)):
        with pytest.raises(CheckpointError) as err:
            load()
        assert str(err.value).endswith(expected) and "\n" not in str(err.value)
    engine.save_checkpoint(root, tag="other", save_latest=False)
    assert engine.load_checkpoint(root)[0] == str(root / "other")  # tag=None falls back to it


def _copy(saved: dict, tmp_path: Path) -> tuple[Path, str]:
    root = tmp_path / "ckpt"
    shutil.copytree(saved["root"] / "full", root)
    return root, (root / "latest").read_text()


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from dslaunch.launcher.cli import main as cli

    code = cli(["zero-to-fp32", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.timeout(60)
def test_without_a_tag_a_corrupt_newest_tag_is_passed_over_out_loud(saved: dict, tmp_path: Path, capsys) -> None:
    root, older = _copy(saved, tmp_path)
    saved["engine"].save_checkpoint(root, tag="newer")
    victim = root / "newer" / "zero_rank_00000.dsl"  # the fp32 masters: what the export reads
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, err = _cli([str(root), str(tmp_path / "out.pt")], capsys)
    assert code == 0 and f"from tag '{older}'" in out
    (line,) = err.splitlines()
    assert line.startswith(f"zero-to-fp32: warning: exported tag '{older}', the newest valid one: tag 'newer': ")
    assert "checksum mismatch" in line and victim.name in line
    _same(torch.load(tmp_path / "out.pt"), saved["expected"])  # the older tag, bit for bit


@pytest.mark.timeout(60)
def test_bad_checkpoint_trees_and_tags_are_one_short_line(saved: dict, tmp_path: Path, capsys) -> None:
    root, tag = _copy(saved, tmp_path)
    out = str(tmp_path / "out.pt")
    (root / "latest").write_text("a" * 5_000_000)  # read whole, then used as a directory name
    code, stdout, err = _cli([str(root), out], capsys)
    assert code == 0 and f"from tag '{tag}'" in stdout and "latest is corrupt" in err and len(err) < 1000, err[:2000]
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "latest").write_text("b" * 5_000_000)
    code, _, err = _cli([str(alone), out], capsys)
    assert code == 1 and err.count("\n") == 1 and len(err) < 1000 and "no checkpoint here" in err, err[:2000]
    for bad_tag in ("../..", "..", "x/../../etc", "a\0b"):
        code, _, err = _cli([str(root), out, "--tag", bad_tag], capsys)
        assert code == 1 and err.startswith("dslaunch: error: invalid checkpoint tag") and err.count("\n") == 1, err
    (root / tag / "manifest.json").write_text("[" * 200_000)  # nested past the JSON parser's stack
    code, _, err = _cli([str(root), out, "--tag", tag], capsys)
    assert code == 1 and err.count("\n") == 1 and "manifest is unreadable (RecursionError" in err, err[:2000]


@pytest.mark.timeout(240)  # six processes importing torch
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_unreadable_inputs_and_a_full_output_disk_are_one_line(saved: dict, tmp_path: Path) -> None:
    root, tag = _copy(saved, tmp_path)
    run = [sys.executable, "-m", "dslaunch.utils.zero_to_fp32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def without_dac(*argv: str) -> subprocess.CompletedProcess:
        """Root that file modes bind (no CAP_DAC_*), on files of user nobody: as another user would."""
        return subprocess.run(["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *run, *argv],
                              capture_output=True, text=True, timeout=60, env=env)

    for path, mode, words in [(root / tag / "zero_rank_00000.dsl", 0o600, "cannot read the file (Permission denied)"),
                              (root / tag / "manifest.json", 0o600, "manifest is unreadable (Permission denied)"),
                              (root / tag, 0o700, "Permission denied"),
                              (root, 0o700, "Permission denied")]:
        os.chown(path, 65534, 65534)
        path.chmod(mode)
        got = without_dac(str(root), str(tmp_path / "x.pt"), "--tag", tag)
        assert got.returncode == 1 and got.stderr.count("\n") == 1 and words in got.stderr, (path, got.stderr)
        os.chown(path, 0, 0)
        path.chmod(0o755 if path.is_dir() else 0o644)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    got = without_dac(str(root), str(theirs / "x.pt"))
    assert got.returncode == 2 and got.stderr.count("\n") == 1 and "cannot write" in got.stderr, got.stderr

    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(full)], check=True, timeout=10)
    try:
        with contextlib.suppress(OSError), open(full / "filler", "wb") as f:
            f.write(bytes(64 * 1024))  # fill the disk up
        got = subprocess.run([*run, str(root), str(full / "x.pt")], capture_output=True, text=True, timeout=60, env=env)
        assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr
        assert got.stderr.startswith(f"zero-to-fp32: error: cannot write {full / 'x.pt'}") and "MB free" in got.stderr
        assert [p.name for p in full.iterdir()] == ["filler"]  # no partial file left
    finally:
        subprocess.run(["umount", str(full)], check=True, timeout=10)


# ---- property: random checkpoint trees ------------------------------------------------------------
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=12)
_CONTENT = st.one_of(st.sampled_from([b"[" * 50_000, b"x" * 300, b"x" * 300_000, b"../..", b"a\0b", b"newer"]),
                     st.binary(max_size=64), st.text(max_size=32).map(str.encode),
                     _JSON.map(lambda v: json.dumps(v).encode()))
_PATHS = ["latest", "{tag}", "{tag}/manifest.json", "{tag}/module.dsl", "{tag}/zero_rank_00000.dsl",
          "{tag}/rank_00000.dsl", "newer", "newer/manifest.json", ".tmp-{tag}", "{tag}/../other"]
_META_KEYS = ["world_size", "partition", "module_keys", "frozen_parameters", "exclude_frozen_parameters", "stage",
              "shared_params"]
_EDIT = st.one_of(
    st.tuples(st.just("write"), st.sampled_from(_PATHS), _CONTENT),
    st.tuples(st.just("remove"), st.sampled_from(_PATHS), st.none()),
    st.tuples(st.just("mkdir"), st.sampled_from(_PATHS), st.none()),
    st.tuples(st.just("truncate"), st.sampled_from(_PATHS[2:6]), st.integers(0, 2000)),
    st.tuples(st.just("meta"), st.sampled_from(_META_KEYS), _JSON),   # re-signed: intact, but not an engine's
    st.tuples(st.just("files"), st.sampled_from(["module.dsl", "zero_rank_00000.dsl"]), _JSON),
)


def _edit(root: Path, tag: str, op: str, where: str, value: Any) -> None:
    import zlib

    if op in ("meta", "files"):
        path = root / tag / "manifest.json"
        # RecursionError: an earlier edit may have written a deeply nested manifest; json cannot read it back
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, RecursionError):
            body = json.loads(path.read_text())["body"]
            body[op][where] = value
            text = json.dumps(body, sort_keys=True)
            path.write_text(json.dumps({"body": body, "crc32": zlib.crc32(text.encode())}))
        return
    path = root / where.format(tag=tag)
    with contextlib.suppress(OSError):
        if op == "remove":
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        elif op == "mkdir":
            path.mkdir(parents=True)
        elif op == "truncate":
            os.truncate(path, value)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(value)


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(latest=st.none() | _CONTENT, edits=st.lists(_EDIT, max_size=4),
       tag=st.sampled_from([None, "global_step2", "newer", "../..", "latest"]),
       output=st.sampled_from(["out.pt", "out", "out.safetensors"]))
def test_any_checkpoint_tree_exports_or_fails_in_one_short_line(saved: dict, latest: bytes | None, edits: list,
                                                                 tag: str | None, output: str) -> None:
    """Whatever a checkpoint directory holds, ``zero-to-fp32`` writes a loadable file or raises one
    ``DslaunchError`` with one bounded line: never another exception, never outside the directory."""
    import tempfile

    from dslaunch.errors import DslaunchError

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(saved["root"] / "full", root)
        real = (root / "latest").read_text()
        for op, where, value in [*edits, *([("write", "latest", latest)] if latest is not None else [])]:
            _edit(root, real, op, where, value)
        out = Path(tmp) / output
        try:
            code = z2f.main([str(root), str(out), *(["--tag", tag] if tag is not None else [])])
        except DslaunchError as err:
            message = str(err)
            assert "\n" not in message and len(message) < 2000, message[:3000]
        else:
            assert code == 0
            written = out if out.suffix else out / "pytorch_model.bin"
            assert written.is_file()


class _Tied(torch.nn.Module):
    """``second.weight`` is ``first.weight`` (a tied embedding and head, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.second = torch.nn.Linear(6, 6)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.first.weight.dtype)
        return self.second(torch.tanh(self.first(x))).float().square().mean()


def _train_tied(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    import dslaunch
    from dslaunch.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = _Tied()
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 6)))
        engine.step()
    engine.save_checkpoint(root, tag="t")
    return {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}


@pytest.mark.timeout(90)
def test_tied_parameters_export_as_one_fp32_tensor(tmp_path: Path) -> None:
    """A tied parameter's every name is its one fp32 master, the same tensor object (DeepSpeed's
    export keeps the tie), never the 16-bit copy; safetensors output copies it per name."""
    from tests.distributed import run_world

    masters = run_world(_train_tied, 2, str(tmp_path / "ckpt"))[0]
    state = z2f.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert state["second.weight"] is state["first.weight"]
    torch.testing.assert_close(state["first.weight"], masters["first.weight"], rtol=0, atol=0)
    torch.testing.assert_close(state["second.bias"], masters["second.bias"], rtol=0, atol=0)
    z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "bin")
    loaded = torch.load(tmp_path / "bin" / "pytorch_model.bin")
    assert loaded["second.weight"].data_ptr() == loaded["first.weight"].data_ptr()
    if HAS_SAFETENSORS:
        from safetensors.torch import load_file

        z2f.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "st", safe_serialization=True)
        tensors = load_file(tmp_path / "st" / "model.safetensors")
        torch.testing.assert_close(tensors["second.weight"], masters["first.weight"], rtol=0, atol=0)
