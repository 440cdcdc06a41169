"""DeepSpeed's bf16 optimizer (``BF16_Optimizer``) tags, both ways, against real DeepSpeed 0.19.8.

DeepSpeed trains with ``BF16_Optimizer`` a bf16 model at ZeRO-1 with ``data_types.grad_accum_dtype:
"fp32"`` and a bf16 ``PipelineModule`` at ZeRO 0 (its files: ``bf16_zero_pp_rank_R_...`` holding that
optimizer's ``state_dict``, padded partitions and ``param_slice_mappings``; at stage 0 no
``param_shapes``). Real DeepSpeed runs ``deepspeed_job.py`` (the MLP, world 2) and
``deepspeed_pipe_job.py`` (2 stages, world 2 or 4), 3 steps, a save, 3 more (its own continuation).
dslaunch loads each tag: right after the load every parameter's fp32 master and Adam moments equal
DeepSpeed's ``safe_get_full_*`` at the save bit for bit, and the next losses equal DeepSpeed's
within 1e-6 (same shape: 0.0; another data-parallel degree or stage count sums bf16 partial results
in another order: measured 2.4e-7 for the pipeline, 7.3e-6 for the MLP at world 1, within 1e-4). The other way,
dslaunch's ``format: "deepspeed"`` tag of the same run holds DeepSpeed's files, tensor for tensor
equal to DeepSpeed's own save, and DeepSpeed's ``load_checkpoint`` continues it.
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.deepspeed_bf16 import slice_shapes
from dslaunch.runtime.checkpoint.deepspeed_read import _StandIn, read_file
from tests.distributed import run_world
from tests.runtime.checkpoint import deepspeed_job as dp_job
from tests.runtime.checkpoint import deepspeed_pipe_job as pipe_job
from tests.runtime.checkpoint.test_deepspeed_interop import _deepspeed_job
from tests.runtime.checkpoint.test_deepspeed_pipe import SCRIPT as PIPE_SCRIPT
from tests.runtime.checkpoint.test_deepspeed_pipe import _joined

pytestmark = pytest.mark.timeout(600)

SAVE_AT, STEPS = 3, 3
FP32_SUMS = {"grad_accum_dtype": "fp32"}


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _differences(a: Any, b: Any, where: str, out: list[str]) -> None:
    """Where ``a`` and ``b`` (two files' objects) differ: keys, tensors (dtype, shape, values),
    scalars; a pickled DeepSpeed object by its attributes (dslaunch's also keep its constructor
    arguments, ``args``: how it is rebuilt, not what it holds)."""
    if isinstance(a, _StandIn) or isinstance(b, _StandIn):
        a, b = ({k: v for k, v in vars(x).items() if k != "args"} if isinstance(x, _StandIn) else x for x in (a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            out.append(f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}")
        for k in set(a) & set(b) - {"ds_config"}:  # the config as each job spelt it
            _differences(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _differences(x, y, f"{where}[{i}]", out)
    elif torch.is_tensor(a) and torch.is_tensor(b):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    elif type(a) is not type(b) or a != b:
        out.append(f"{where}: {a!r} vs {b!r}"[:200])


def file_differences(ours: Path, theirs: Path) -> list[str]:
    """How the ``.pt`` files of tag folder ``ours`` differ from those of ``theirs`` (names, contents)."""
    out = [f"files {sorted({f.name for f in ours.glob('*.pt')} ^ {f.name for f in theirs.glob('*.pt')})}"] \
        if {f.name for f in ours.glob("*.pt")} != {f.name for f in theirs.glob("*.pt")} else []
    for f in sorted(theirs.glob("*.pt")):
        if (ours / f.name).exists():
            _differences(read_file(ours / f.name), read_file(f), f.name, out)
    return out


def _deepspeed(python: Path, base: Path, name: str, world: int, job: dict, script: Path | None = None
               ) -> tuple[Path, list[dict]]:
    folder = base / name
    results = _deepspeed_job(python, base / f"{name}.json", base / "ext", world,
                             {**job, "bf16": True, "first": 0, "steps": SAVE_AT + STEPS, "save": str(folder),
                              "save_at": SAVE_AT}, **({"script": script} if script else {}))
    return folder, results


@pytest.fixture(scope="module")
def deepspeed_tags(deepspeed_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list]]:
    """DeepSpeed's BF16_Optimizer tags: the MLP at ZeRO-1 (world 2), the pipeline at ZeRO-1 (2
    stages, world 2) and at ZeRO 0 (2 stages x 2 replicas, world 4); each with its per-rank results."""
    base = tmp_path_factory.mktemp("deepspeed-bf16")
    return {"dp": _deepspeed(deepspeed_python, base, "dp", 2, {"stage": 1, "data_types": FP32_SUMS}),
            "pipe1": _deepspeed(deepspeed_python, base, "pipe1", 2,
                                {"stages": 2, "stage": 1, "data_types": FP32_SUMS}, PIPE_SCRIPT),
            "pipe0": _deepspeed(deepspeed_python, base, "pipe0", 4, {"stages": 2, "stage": 0}, PIPE_SCRIPT)}


def _dp(rank: int, world: int, kwargs: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return dp_job.run(dslaunch, rank, world, 1, bf16=True, data_types=FP32_SUMS, **kwargs)


def _pipe(rank: int, world: int, stages: int, stage: int, kwargs: dict) -> dict:
    import dslaunch

    dslaunch.init_distributed(dist_backend="gloo")
    return pipe_job.run(dslaunch, rank, world, stages, stage=stage, bf16=True,
                        data_types=FP32_SUMS if stage == 1 else None, **kwargs)


def _means(results: list[dict]) -> list[float]:
    """Each step's loss over the global batch (each rank's is over its share of it)."""
    return [sum(step) / len(step) for step in zip(*(r["losses"] for r in results), strict=True)]


@pytest.mark.parametrize("world", [2, 1])
def test_dslaunch_continues_deepspeeds_bf16_zero1(deepspeed_tags: dict, world: int) -> None:
    folder, ds = deepspeed_tags["dp"]
    got = run_world(_dp, world, {"first": SAVE_AT, "steps": STEPS, "load": str(folder)}, timeout=240)
    assert got[0]["state"] == ds[0]["state"]  # masters and moments as DeepSpeed had them at the save
    # world 1 sums the 8 samples' bf16 gradients in one backward, DeepSpeed's two ranks 4 each, then
    # the two fp32 sums: measured 7.3e-6 apart
    tolerance = 1e-6 if world == 2 else 1e-4
    assert _worst(_means(got), _means(ds)[SAVE_AT:]) <= tolerance, (_means(got), _means(ds)[SAVE_AT:])
    assert got[0]["global_steps"] == SAVE_AT


@pytest.mark.parametrize(("tag", "stages", "world"), [("pipe1", 2, 2), ("pipe1", 2, 4), ("pipe0", 2, 4),
                                                      ("pipe0", 2, 2), ("pipe0", 1, 2)])
def test_dslaunch_continues_deepspeeds_bf16_pipeline(deepspeed_tags: dict, tag: str, stages: int, world: int) -> None:
    """ZeRO-0 (``BF16_Optimizer`` without ``param_shapes``: its files' slice mappings name the
    parameters, cut over 2 replicas here) loads by name like ZeRO-1, also at another shape."""
    folder, ds = deepspeed_tags[tag]
    got = run_world(_pipe, world, stages, 1 if tag == "pipe1" else 0,
                    {"first": SAVE_AT, "steps": STEPS, "load": str(folder)}, timeout=240)
    assert _joined(got) == _joined(ds)
    assert _worst(got[0]["losses"], ds[0]["losses"][SAVE_AT:]) <= 1e-6, (got[0]["losses"], ds[0]["losses"])
    assert got[0]["global_steps"] == SAVE_AT


def test_dslaunch_writes_deepspeeds_bf16_zero1(deepspeed_tags: dict, deepspeed_python: Path, tmp_path: Path) -> None:
    folder, ds = deepspeed_tags["dp"]
    save = tmp_path / "ck"
    ours = run_world(_dp, 2, {"first": 0, "steps": SAVE_AT + STEPS, "save": str(save), "save_at": SAVE_AT,
                              "checkpoint": {"format": "deepspeed"}}, timeout=240)
    assert ours[0]["losses"] == ds[0]["losses"]  # the same run, so the files can be compared
    assert file_differences(save / "global_step3", folder / "global_step3") == []
    # DeepSpeed's safe_get_full_* fail on its BF16_Optimizer before the first step after a load: no probe
    theirs = _deepspeed_job(deepspeed_python, tmp_path / "load.json", tmp_path / "ext", 2,
                            {"stage": 1, "bf16": True, "data_types": FP32_SUMS, "first": SAVE_AT, "steps": STEPS,
                             "load": str(save), "probe": False})
    assert _worst(theirs[0]["losses"], ours[0]["losses"][SAVE_AT:]) <= 1e-6
    assert theirs[0]["global_steps"] == SAVE_AT


def test_dslaunch_writes_deepspeeds_bf16_pipeline_zero1(deepspeed_tags: dict, tmp_path: Path) -> None:
    folder, ds = deepspeed_tags["pipe1"]
    save = tmp_path / "ck"
    ours = run_world(_pipe, 2, 2, 1, {"first": 0, "steps": SAVE_AT + STEPS, "save": str(save), "save_at": SAVE_AT,
                                      "checkpoint": {"format": "deepspeed"}, "probe": False}, timeout=240)
    assert ours[0]["losses"] == ds[0]["losses"]
    assert file_differences(save / "global_step3", folder / "global_step3") == []


def test_dslaunch_writes_deepspeeds_bf16_pipeline_zero0(deepspeed_tags: dict, tmp_path: Path) -> None:
    """Stage 0: every rank's ``bf16_zero_pp_rank_D_mp_rank_SS`` file and rank 0's copy in the model
    states, as DeepSpeed's save; dslaunch loads it with its optimizer state (DeepSpeed 0.19.8 loads
    such a tag only with ``load_optimizer_states=False``: ``test_deepspeed_pipe_bf16``)."""
    folder, ds = deepspeed_tags["pipe0"]
    save = tmp_path / "ck"
    ours = run_world(_pipe, 4, 2, 0, {"first": 0, "steps": SAVE_AT + STEPS, "save": str(save), "save_at": SAVE_AT,
                                      "checkpoint": {"format": "deepspeed"}, "probe": False}, timeout=240)
    assert ours[0]["losses"] == ds[0]["losses"]
    assert file_differences(save / "global_step3", folder / "global_step3") == []
    again = run_world(_pipe, 2, 2, 0, {"first": SAVE_AT, "steps": STEPS, "load": str(save)}, timeout=240)
    assert _joined(again) == _joined(ds)
    assert _worst(again[0]["losses"], ds[0]["losses"][SAVE_AT:]) <= 1e-6


def _load_once(rank: int, world: int, load: str) -> str:
    from dslaunch.errors import CheckpointError

    try:
        _pipe(rank, world, 2, 0, {"first": SAVE_AT, "steps": 0, "load": load, "probe": False})
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_a_missing_bf16_optimizer_file_is_named(deepspeed_tags: dict, tmp_path: Path) -> None:
    folder, _ = deepspeed_tags["pipe0"]
    broken = tmp_path / "ck"
    shutil.copytree(folder, broken)
    (broken / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    msgs = run_world(_load_once, 4, str(broken), timeout=120)
    assert "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" in msgs[0] and "\n" not in msgs[0], msgs


class _Address:
    """A pickled ``fragment_address`` as dslaunch reads it (its attributes)."""

    def __init__(self, numel: int, start: int) -> None:
        self.numel, self.start = numel, start


def _rank_file(share: int, mappings: dict[str, tuple[int, int]]) -> dict:
    return {"single_partition_of_fp32_groups": [torch.zeros(share)], "base_optimizer_state": {},
            "param_slice_mappings": [{n: _Address(*a) for n, a in mappings.items()}]}


def test_slice_mappings_name_and_shape_a_stage0_groups_parameters() -> None:
    """Without ``param_shapes`` (stage 0) the ranks' mappings give each parameter's place: one cut
    over two ranks' shares joins, the layer files give shapes; a gap is one line."""
    files = [Path("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"), Path("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")]
    osds = [_rank_file(6, {"0.weight": (6, 0)}), _rank_file(6, {"0.weight": (2, 0), "0.bias": (2, 2)})]
    shapes = slice_shapes(osds, files, {"0.weight": torch.zeros(2, 4)})
    assert shapes == [OrderedDict([("0.weight", torch.Size([2, 4])), ("0.bias", torch.Size([2]))])]
    osds[1] = _rank_file(6, {"0.weight": (2, 0), "0.bias": (2, 3)})
    with pytest.raises(CheckpointError, match="'0.bias'.*without a gap"):
        slice_shapes(osds, files, {})
