"""``deepspeed.checkpoint.DeepSpeedCheckpoint`` / ``ZeROCheckpoint``: DeepSpeed's layout read file by
file at a target shape, as Megatron-DeepSpeed's conversion tools read it.

dslaunch saves the pipeline job of ``deepspeed_pipe_job`` (2 stages x 2 replicas, ZeRO-1, gloo) in
DeepSpeed's format; ``DeepSpeedCheckpoint`` reads its embedding, transformer and final layers
equal to the job's weights at the save, each replica's ZeRO partition, and the same at 1 stage x 1
replica (stages' and replicas' files joined). Real DeepSpeed 0.19.8's save of the same job reads
the same. dslaunch's pipelines have no tensor axis, so the tensor-parallel joining is checked on a
tag in Megatron-DeepSpeed's naming (``layer_XX-model_TT-model_states.pt``) cut from known tensors.
"""

from __future__ import annotations

import argparse
import enum
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dslaunch.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, merge_state
from dslaunch.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, OPTIMIZER_STATE_DICT
from dslaunch.errors import CheckpointError, CheckpointLayoutError, ReshapeError
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_pipe_job as job
from tests.runtime.checkpoint.test_deepspeed_pipe import SAVE_AT, deepspeed_saved  # noqa: F401

pytestmark = pytest.mark.timeout(300)

LAYERS = [f"layer_{i:02d}" for i in range(6)]  # the job's six layers; 1 and 3 (Tanh) have no weights
FP32 = "single_partition_of_fp32_groups"


def _save(rank: int, world: int, save: str) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return job.run(dslaunch, rank, world, 2, first=0, steps=SAVE_AT + 1, save=save, save_at=SAVE_AT,
                   checkpoint={"format": "deepspeed"})


@pytest.fixture(scope="module")
def dslaunch_saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """dslaunch's DeepSpeed-format tag of the job at 2 stages x 2 replicas, and the weights at the save."""
    folder = tmp_path_factory.mktemp("dsckpt") / "ck"
    results = run_world(_save, 4, str(folder), timeout=240)
    state = {k: torch.tensor(v) for r in results for k, v in r["state"].items() if ":" not in k}
    return folder / f"global_step{SAVE_AT}", state


def _layer(state: dict, index: int) -> dict:
    return {k.split(".", 1)[1]: v for k, v in state.items() if k.split(".", 1)[0] == str(index)}


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        assert torch.equal(got[k].reshape(-1).float(), want[k].reshape(-1)), k


def _check_layers(ck: DeepSpeedCheckpoint, state: dict) -> None:
    assert ck.layer_keys == LAYERS
    _equal(ck.get_embedding_state(0), _layer(state, 0))
    _equal(ck.get_final_norm_state(0), _layer(state, 5))
    layers = [t for pp in range(ck.pp_degree) for t in ck.get_transformer_state(tp_index=0, pp_index=pp)]
    for got, index in zip(layers, range(1, 5), strict=True):
        _equal(got, _layer(state, index))


def test_dslaunchs_pipeline_tag_reads_as_saved(dslaunch_saved: tuple[Path, dict]) -> None:
    tag, state = dslaunch_saved
    ck = DeepSpeedCheckpoint(str(tag))
    assert (ck.pp_degree, ck.tp_degree, ck.dp_degree, ck.original_world_size) == (2, 1, 2, 4)
    assert ck.get_pp_transformer_map(0) == LAYERS[1:3] and ck.get_pp_transformer_map(1) == LAYERS[3:5]
    _check_layers(ck, state)
    assert ck.get_iteration() == 0 and ck.get_args() is None  # no Megatron keys in a DeepSpeed engine's save
    # each replica's ZeRO-1 partition of stage 1's one param group; joined, the stage's weights in order
    osds = [ck.get_zero_checkpoint_state(pp_index=1, tp_index=0, dp_index=d)[OPTIMIZER_STATE_DICT] for d in range(2)]
    parts = [osd[FP32][0] for osd in osds]
    names = [n for n in state if int(n.split(".")[0]) >= 3]  # named_parameters() order
    whole = torch.cat([state[n].reshape(-1) for n in names])
    assert torch.equal(torch.cat(parts), whole)
    assert parts[0].numel() > 0 and parts[1].numel() > 0
    # each rank's fragments (what Megatron-DeepSpeed's checkpoint verifier narrows the partition by)
    offsets = dict(zip(names, torch.tensor([0] + [state[n].numel() for n in names]).cumsum(0).tolist(), strict=False))
    for d, osd in enumerate(osds):
        for name, frag in osd["param_slice_mappings"][0].items():
            at = d * parts[0].numel() + frag.start
            assert offsets[name] <= at and at + frag.numel <= offsets[name] + state[name].numel(), (name, d)
            assert torch.equal(parts[d].narrow(0, frag.start, frag.numel), whole.narrow(0, at, frag.numel))


def test_reshaped_to_one_stage_and_replica_joins_the_files(dslaunch_saved: tuple[Path, dict]) -> None:
    tag, state = dslaunch_saved
    ck = DeepSpeedCheckpoint(str(tag), tp_degree=1, pp_degree=1, dp_degree=1)
    assert (ck.pp_degree, ck.dp_degree, ck.world_size) == (1, 1, 1)
    assert ck.get_pp_transformer_map(0) == LAYERS[1:5]
    _check_layers(ck, state)
    assert [Path(f).name for f in ck.get_2d_parallel_files(tp_index=0, pp_index=0)] == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
    shapes = ck.get_2d_parallel_state(tp_index=0, pp_index=0)["param_shapes"][0]
    assert sorted(shapes) == sorted(state)  # both stages' parameters
    # ZeRO: 4 files (2 stages x 2 replicas) joined per stage, then stage after stage
    assert [Path(f).name for f in ck.get_zero_files(0, 0, 0)] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    osd = ck.get_zero_checkpoint_state(0, 0, 0)[OPTIMIZER_STATE_DICT]
    by_stage = [n for s in (range(0, 3), range(3, 6)) for n in state if int(n.split(".")[0]) in s]
    assert torch.equal(osd[FP32][0], torch.cat([state[n].reshape(-1) for n in by_stage]))
    assert osd["partition_count"] == [1]


def test_deepspeeds_own_pipeline_tag_reads_the_same(deepspeed_saved: tuple[Path, list[dict]],  # noqa: F811
                                                    dslaunch_saved: tuple[Path, dict]) -> None:
    folder, results = deepspeed_saved
    theirs = {k: torch.tensor(v) for r in results for k, v in r["state"].items() if ":" not in k}
    ck = DeepSpeedCheckpoint(str(folder / f"global_step{SAVE_AT}"), pp_degree=1)
    assert (ck.zero_checkpoint.get_src_pp_degree(), ck.zero_checkpoint.get_src_dp_degree()) == (2, 1)
    _check_layers(ck, theirs)  # the weights real DeepSpeed had at the save, bit for bit
    ours = dslaunch_saved[1]  # the same job trained by dslaunch: the same weights
    assert max((theirs[k] - ours[k]).abs().max().item() for k in ours) < 1e-6


# ---- a tensor axis: Megatron-DeepSpeed's naming, written from known tensors --------------------------
class _Position(enum.Enum):  # Megatron keeps enums in its args: read as stand-ins, never run
    absolute = 1


def _megatron_tag(folder: Path) -> dict[str, torch.Tensor]:
    """pp 2 x tp 2 x dp 1: embedding (cut dim 0), two transformer layers per stage, final norm."""
    g = torch.Generator().manual_seed(0)
    full = {"emb": torch.randn(8, 4, generator=g), "norm": torch.randn(4, generator=g)}
    layer_ids = [1, 3, 4, 5, 6, 8]  # 1 embedding, 3-6 transformer layers, 8 final norm
    for i in layer_ids[1:5]:
        full[f"{i}.ln"] = torch.randn(4, generator=g)
        full[f"{i}.dense"] = torch.randn(4, 6, generator=g)  # row-parallel: cut along dim 1
        full[f"{i}.h_to_4h"] = torch.randn(6, 4, generator=g)  # cut along dim 0
    module = types.ModuleType("megatron.enums")
    _Position.__module__ = module.__name__
    module._Position = _Position  # type: ignore[attr-defined]
    added = [name for name in ("megatron", "megatron.enums") if name not in sys.modules]
    sys.modules.setdefault("megatron", types.ModuleType("megatron"))
    sys.modules["megatron.enums"] = module
    try:
        for tp in range(2):
            def save(layer: int, sd: dict, tp: int = tp) -> None:
                torch.save(sd, folder / f"layer_{layer:02d}-model_{tp:02d}-model_states.pt")

            save(1, {"word_embeddings.weight": full["emb"].chunk(2, 0)[tp]})
            for i in layer_ids[1:5]:
                save(i, {"input_layernorm.weight": full[f"{i}.ln"],
                         "self_attention.dense.weight": full[f"{i}.dense"].chunk(2, 1)[tp],
                         "mlp.dense_h_to_4h.weight": full[f"{i}.h_to_4h"].chunk(2, 0)[tp]})
            save(8, {"weight": full["norm"]})
        for mp in range(4):
            args = argparse.Namespace(tensor_model_parallel_size=2, position_embedding_type=_Position.absolute)
            torch.save({"iteration": 7, "args": args, "module": None,
                        CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 2, "tp_degree": 2}},
                       folder / f"mp_rank_{mp:02d}_model_states.pt")
            torch.save({OPTIMIZER_STATE_DICT: {FP32: [torch.full((3,), float(mp))], "partition_count": [1],
                                               "group_paddings": [0]}},
                       folder / f"bf16_zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt")
    finally:
        for name in added:  # the reader must not need Megatron
            del sys.modules[name]
    return full


def test_tensor_parallel_slices_join_by_megatrons_rules(tmp_path: Path) -> None:
    full = _megatron_tag(tmp_path)
    src = DeepSpeedCheckpoint(str(tmp_path))
    assert (src.pp_degree, src.tp_degree, src.dp_degree) == (2, 2, 1)
    assert src.get_iteration() == 7 and src.get_args().tensor_model_parallel_size == 2
    assert torch.equal(src.get_embedding_state(1)["word_embeddings.weight"], full["emb"][4:])
    assert [Path(f).name for f in src.get_2d_parallel_files(tp_index=1, pp_index=1)] == ["mp_rank_03_model_states.pt"]

    ck = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1, pp_degree=1)
    assert torch.equal(ck.get_embedding_state(0)["word_embeddings.weight"], full["emb"])
    assert torch.equal(ck.get_final_norm_state(0)["weight"], full["norm"])
    layers = ck.get_transformer_state(tp_index=0, pp_index=0)
    assert len(layers) == 4
    for sd, i in zip(layers, (3, 4, 5, 6), strict=True):
        assert torch.equal(sd["input_layernorm.weight"], full[f"{i}.ln"])  # replicated: taken once
        assert torch.equal(sd["self_attention.dense.weight"], full[f"{i}.dense"])
        assert torch.equal(sd["mlp.dense_h_to_4h.weight"], full[f"{i}.h_to_4h"])
    # the ZeRO files pipeline-major (mp_rank = pp * tp + t), joined tp first then stage
    fp32 = ck.get_zero_checkpoint_state(0, 0, 0)[OPTIMIZER_STATE_DICT][FP32][0]
    assert fp32.tolist() == [float(mp) for mp in (0, 1, 2, 3) for _ in range(3)]
    # tp only: each stage keeps its own files
    tp1 = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1)
    assert [Path(f).name for f in tp1.get_2d_parallel_files(tp_index=0, pp_index=1)] == [
        "mp_rank_02_model_states.pt", "mp_rank_03_model_states.pt"]
    assert [len(tp1.get_transformer_state(0, pp)) for pp in (0, 1)] == [2, 2]


def test_bad_input_is_one_line_naming_it(tmp_path: Path) -> None:
    _megatron_tag(tmp_path)
    for kwargs, named in (({"tp_degree": 3}, "tp_degree=3"), ({"pp_degree": 4}, "pp_degree=4"),
                          ({"dp_degree": 0}, "dp_degree=0")):
        with pytest.raises(ReshapeError) as err:
            DeepSpeedCheckpoint(str(tmp_path), **kwargs)
        assert named in str(err.value) and str(tmp_path) in str(err.value) and "\n" not in str(err.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (empty, tmp_path / "missing", tmp_path / "layer_01-model_00-model_states.pt"):
        with pytest.raises(CheckpointError, match="tag folder") as err:
            DeepSpeedCheckpoint(str(folder))
        assert str(folder) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="no ZeRO optimizer files"):
        ZeROCheckpoint(str(empty))
    for f in tmp_path.glob("bf16_zero_*"):  # saved without ZeRO: the layers read, the optimizer state is refused
        f.unlink()
    ck = DeepSpeedCheckpoint(str(tmp_path), tp_degree=1)
    assert ck.dp_degree == 1 and ck.get_final_norm_state(0)
    with pytest.raises(CheckpointError, match="no ZeRO optimizer files"):
        ck.get_zero_checkpoint_state(0, 0, 0)
    (tmp_path / "mp_rank_03_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="mp_rank_03_model_states.pt: unreadable"):
        DeepSpeedCheckpoint(str(tmp_path))
    torch.save({CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, "tp_degree": 4}}, tmp_path / "mp_rank_03_model_states.pt")
    with pytest.raises(CheckpointLayoutError, match="disagrees across model-state files"):
        get_model_3d_descriptor(str(tmp_path))
    # a conversion script (no initialize) that passes a bad folder: one line, no traceback
    script = f"from dslaunch.checkpoint import DeepSpeedCheckpoint; DeepSpeedCheckpoint({str(tmp_path / 'nope')!r})"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "DSLAUNCH_VERBOSE"})
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        f"dslaunch: error: {tmp_path / 'nope'}: does not exist: pass a DeepSpeed checkpoint tag folder"], run.stderr
    with pytest.raises(ReshapeError, match="cannot merge a Tensor with a list at a.b"):
        merge_state({"a": {"b": torch.ones(1)}}, {"a": {"b": [1]}})


# ---- the rest of deepspeed.checkpoint -----------------------------------------------------------------
def test_parameters_load_from_a_universal_tag(dslaunch_saved: tuple[Path, dict], tmp_path: Path) -> None:
    from dslaunch.checkpoint import enable_universal_checkpoint
    from dslaunch.runtime.checkpoint.universal import convert

    tag, state = dslaunch_saved
    out = convert(tag, tmp_path / "universal")
    whole = torch.nn.Parameter(torch.zeros(7, 5))
    enable_universal_checkpoint([whole])
    step = whole.load_hp_checkpoint_state(out / "zero" / "0.weight", 0, 1)
    assert torch.equal(whole.detach(), state["0.weight"].reshape(7, 5)) and int(step) == SAVE_AT
    # a tensor rank's slice along the file's cat_dim
    sliced = tmp_path / "zero" / "dense.weight"
    sliced.mkdir(parents=True)
    full = torch.arange(24.0).reshape(4, 6)
    torch.save({"param": full, "cat_dim": 1}, sliced / "fp32.pt")
    half = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    enable_universal_checkpoint([half])
    assert half.load_hp_checkpoint_state(str(sliced), tp_rank=1, tp_world_size=2) is None  # no step.pt
    assert torch.equal(half.detach().float(), full[:, 3:])
    with pytest.raises(CheckpointError, match=r"fp32.pt: holds \(4, 6\), which is not the parameter's \(4, 4\)"):
        wrong = torch.nn.Parameter(torch.zeros(4, 4))
        enable_universal_checkpoint([wrong])
        wrong.load_hp_checkpoint_state(str(sliced), tp_rank=0, tp_world_size=2)


def test_checkpoint_parallel_metadata_names_the_grid() -> None:
    from dslaunch.runtime.checkpoint.deepspeed_checkpoint import checkpoint_parallel_metadata

    class Mpu:
        def get_pipeline_model_parallel_world_size(self) -> int:
            return 3

        def get_tensor_model_parallel_world_size(self) -> int:
            return 2

    assert checkpoint_parallel_metadata(None) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 1, "tp_degree": 1}}
    assert checkpoint_parallel_metadata(Mpu()) == {CHECKPOINT_PARALLEL_DIMS: {"pp_degree": 3, "tp_degree": 2}}
