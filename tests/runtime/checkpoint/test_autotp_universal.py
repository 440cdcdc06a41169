"""AutoTP training tags into DeepSpeed's universal layout and back.

A tiny GQA language model (and a GPT-2-style one of ``Conv1D`` layers) trains at ``autotp_size`` 2 on 2 gloo ranks (ZeRO-1), is saved, and
``dslaunch ds-to-universal`` converts the tag; ``load_universal`` loads the result at tp 2 (the
same shape) and at tp 1 x dp 2 (ZeRO-2). The continuation at tp 2 equals the unconverted run bit
for bit, at tp 1 within 1e-6, and the converted whole tensors equal ``zero_to_fp32``'s export of
the tag exactly. DeepSpeed's slice records (``universal_checkpoint_info``, a parameter's AutoTP
restore record) are checked by their round trip: joining slices and cutting the whole again gives
back every rank's slice, uneven GQA widths and row-parallel splits included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.errors import CheckpointError, SliceMetadataError, UnconvertibleLayoutError
from dslaunch.runtime.checkpoint.autotp_universal import (
    SliceRules,
    rank_slice,
    refuse_unsupported,
    shapes_by_tp,
)
from dslaunch.runtime.checkpoint.deepspeed_constants import (
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    CAT_DIM,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
)
from dslaunch.runtime.checkpoint.universal_restore import load_state
from dslaunch.runtime.checkpoint.universal_tp import merge_tp_slices
from tests.distributed import run_world
from tests.runtime.tensor_parallel.models import VOCAB, TrainableLM, next_token_loss, rule_batch

pytestmark = pytest.mark.timeout(240)

BATCH, SEQ, SAVE_AT, MORE = 8, 12, 4, 3


# ---- the slice records, in one process ------------------------------------------------------------
def _gqa_rules() -> tuple[SliceRules, list[list[int]]]:
    # a fused QKV of 6 query rows and 3 + 3 key/value rows over 2 ranks: the heads go 2/1, so
    # rank 0 holds 4 + 2 + 2 rows and rank 1 holds 2 + 1 + 1
    widths = [[4, 2], [2, 1], [2, 1]]
    info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4,
            PARAMETER_WITH_SUB_PARAMS: [{"patterns": [r"^qkv\.weight$"], "shape": [(6, 3, 3), -1], "partition_dim": 0}],
            SUB_PARAM_SHARD_WIDTHS: {r"^qkv\.weight$": widths}, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^o\.weight$"],
            TP_REPLICATED_PARAMETER_PATTERNS: [r"^norm\.weight$"]}
    return SliceRules.from_info(info), widths


def test_joining_and_cutting_uneven_gqa_slices_are_inverse() -> None:
    rules, widths = _gqa_rules()
    whole = torch.arange(24, dtype=torch.float32).view(12, 2)
    q, k, v = whole.split([6, 3, 3])
    slices = [torch.cat([q[:4], k[:2], v[:2]]), torch.cat([q[4:], k[2:], v[2:]])]
    joined, extras, used = rules.merge("qkv.weight", slices, 2)
    assert torch.equal(joined, whole) and used == {r"^qkv\.weight$"}
    meta = {"partition_dim": 0, "logical_shape": (12, 2), "sub_param_sizes": (6, 3, 3),
            "sub_param_shard_widths": widths, UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4}
    for rank, mine in enumerate(slices):
        assert torch.equal(rank_slice(meta, joined, rank, 2), mine.flatten())
    # a row-parallel weight joins along its input dimension, an uneven split cut back by its sizes
    o = [torch.arange(12.0).view(4, 3), torch.arange(12.0, 20.0).view(4, 2)]
    joined, extras, _ = rules.merge("o.weight", o, 2)
    assert extras[CAT_DIM] == 1 and joined.shape == (4, 5)
    meta = {"partition_dim": 1, "logical_shape": (4, 5), "partition_sizes": (3, 2)}
    assert [torch.equal(rank_slice(meta, joined, r, 2), o[r].flatten()) for r in (0, 1)] == [True, True]


def test_inconsistent_slice_records_are_refused_in_one_line() -> None:
    rules, _ = _gqa_rules()
    with pytest.raises(SliceMetadataError, match="hold different values") as err:
        rules.merge("norm.weight", [torch.ones(4), torch.zeros(4)], 2)
    assert "\n" not in str(err.value)
    with pytest.raises(SliceMetadataError, match="recorded shard widths describe"):
        rules.merge("qkv.weight", [torch.zeros(6, 2), torch.zeros(6, 2)], 2)
    with pytest.raises(SliceMetadataError, match="records no partition_sizes"):  # 10 over 4: AutoTP's 3,3,2,2
        rank_slice({"partition_dim": 0, "logical_shape": (10, 2)}, torch.zeros(10, 2), 3, 4)
    with pytest.raises(SliceMetadataError, match="disagree on shape"):
        shapes_by_tp([{"w": (3, 4)}, {"w": (2, 4)}, {"w": (1, 4)}, {"w": (2, 4)}], 2, 2)
    with pytest.raises(UnconvertibleLayoutError, match="interleaved") as err:
        refuse_unsupported({AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {"^qkv$": "its layout is interleaved"}}, "ck/x.pt")
    assert isinstance(err.value, ValueError) and str(err.value).startswith("ck/x.pt: ")


def test_merge_tp_slices_writes_what_the_restore_cuts_back(tmp_path: Path) -> None:
    rules_info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^o\.weight$"]}
    slices = [torch.arange(12.0).view(4, 3), torch.arange(12.0, 20.0).view(4, 2)]
    for tp, piece in enumerate(slices):
        for dp, half in enumerate(piece.reshape(-1).chunk(2)):  # two data-parallel fragments each
            folder = tmp_path / "tmp" / "o.weight" / str(tp)
            folder.mkdir(parents=True, exist_ok=True)
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.save(half.clone(), folder / f"{state}.{dp:02d}")
    unused = merge_tp_slices(rules_info, tmp_path / "zero", tmp_path / "tmp", 2, ("o.weight", [(4, 3), (4, 2)]))
    whole, info = load_state(tmp_path / "zero" / "o.weight" / "fp32.pt")
    assert not unused and info[CAT_DIM] == 1 and torch.equal(whole, torch.cat(slices, dim=1))
    with pytest.raises(SliceMetadataError, match="is not empty"):  # a rank that owns rows wrote nothing
        merge_tp_slices(rules_info, tmp_path / "zero", tmp_path / "tmp", 3, ("o.weight", [(4, 3), (4, 2), (4, 1)]))


# ---- a real AutoTP run --------------------------------------------------------------------------
class Conv1D(nn.Module):
    """GPT-2's ``Conv1D``: a Linear whose weight is stored ``[in, out]``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


class ConvLM(nn.Module):
    """A GPT-2-style MLP block of ``Conv1D`` layers between an embedding and a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)
        self.c_fc, self.c_proj = Conv1D(64, 32), Conv1D(32, 64)
        self.loss_function = next_token_loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids)
        logits = self.head(h + self.c_proj(F.gelu(self.c_fc(h))))
        return logits if labels is None else self.loss_function(logits=logits, labels=labels, vocab_size=VOCAB)


MODELS = {"gqa": TrainableLM, "conv1d": ConvLM}


def _engine(tp: int, world: int, stage: int, universal: bool = False, model: str = "gqa"):
    import dslaunch

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": BATCH // (world // tp), "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 3e-3}}, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tp},
              "checkpoint": {"load_universal": universal}, "steps_per_print": 1000}
    return dslaunch.initialize(model=MODELS[model](), config=config)[0]


def _steps(engine, first: int, count: int) -> list[float]:
    micro = BATCH // engine.dp_world_size
    data_rank, out = engine.grid.get_data_parallel_rank(), []
    for step in range(first, first + count):
        ids = rule_batch(step, BATCH, SEQ)[data_rank * micro:(data_rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        out.append(mean.item() / torch.distributed.get_world_size())
    return out


def _round_trip(rank: int, world: int, root: str, model: str, stage: int) -> dict:
    from dslaunch.runtime.checkpoint.universal import convert

    engine = _engine(2, world, stage, model=model)
    _steps(engine, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="t4")
    straight = _steps(engine, SAVE_AT, MORE)
    if rank == 0:
        convert(Path(root) / "t4", Path(root) / "t4_universal")
    torch.distributed.barrier()
    same = _engine(2, world, stage, universal=True, model=model)
    same.load_checkpoint(root)  # the tag latest_universal names
    whole = _engine(1, world, 2, universal=True, model=model)
    whole.load_checkpoint(root, tag="t4_universal")
    loaded = {k: v.detach().clone() for k, v in whole.module.state_dict().items()}
    return {"straight": straight, "same": _steps(same, SAVE_AT, MORE), "whole": _steps(whole, SAVE_AT, MORE),
            "loaded": loaded, "steps": (same.global_steps, whole.global_steps)}


@pytest.mark.parametrize(("model", "stage"), [("gqa", 1), ("conv1d", 1), ("gqa", 3)])
def test_a_tp2_tag_converted_loads_at_tp2_and_at_tp1_with_another_dp(tmp_path: Path, model: str, stage: int) -> None:
    """``conv1d``: weights the model stores ``[in, out]`` are converted in that layout (as DeepSpeed's
    tools and a tp 1 model want them) and turned back for the sharded layers on load. Stage 3: the
    tag's data-parallel partitions of each slice are joined too (loaded at tp 2 at stage 3)."""
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = run_world(_round_trip, 2, str(tmp_path), model, stage, timeout=240)
    exported = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t4")
    for rank in got:
        assert rank["same"] == rank["straight"], rank  # the slices joined and cut again exactly
        assert max(abs(a - b) for a, b in zip(rank["whole"], rank["straight"], strict=True)) <= 1e-6, rank
        assert rank["steps"] == (SAVE_AT + MORE, SAVE_AT + MORE)
        for name, value in exported.items():  # the whole masters, as zero_to_fp32 joins the slices
            assert torch.equal(rank["loaded"][name], value), name
    for name, value in exported.items():
        stored, _ = load_state(tmp_path / "t4_universal" / "zero" / name / "fp32.pt")
        assert torch.equal(stored, value), name


def test_what_the_conversion_refuses(tmp_path: Path) -> None:
    from dslaunch.runtime.checkpoint.universal import convert

    with pytest.raises(CheckpointError) as err:
        convert(tmp_path / "nothing", tmp_path / "out")
    assert "\n" not in str(err.value) and "nothing" in str(err.value)
