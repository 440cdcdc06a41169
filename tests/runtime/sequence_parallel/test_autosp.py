"""AutoSP (``deepspeed.sequence.auto_sp``, ``autosp_vit``, ``autosp_fusion``) on 2 gloo ranks.

- ``UlyssesSPViTAttention`` around a plain-torch bidirectional attention, on a patch sequence split
  over the ranks (even and uneven shards, with and without a ``[CLS]`` token): each rank's output
  is its rows of the one-process output, and the gradients of its input shard and (summed over
  the ranks) of the weights and the ``[CLS]`` input are the one-process gradients.
- ``LlavaFusionAdapter`` with a linear projector: the ranks' parts reassemble into the fused
  sequence built by hand in one process (padded), and the projector, visual and text gradients
  are that sequence's. ``InternVLFusionAdapter`` and ``Qwen2VLFusionAdapter`` take visual shards of
  different lengths (3/2) and refuse too few visual tokens and unpaired vision start/end tokens.
- ``auto_wrap_model_for_sp``: what it wraps (the registries' ``[CLS]`` rule), what it reports and
  leaves (language-model attention, the projector), a second call wraps nothing twice, and the
  refusals (no known attention; ranks whose shards differ outside the sequence).

The Hugging Face ViT under ``deepspeed.initialize`` is ``test_autosp_hf.py``.
"""

from __future__ import annotations

import datetime
import logging

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_world

HIDDEN, HEADS = 16, 4


class SelfAttention(torch.nn.Module):
    """Bidirectional multi-head attention on ``[batch, sequence, hidden]``, returning ``(output,
    None)`` as Hugging Face's vision attention does; ``attention_mask`` positional."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(HIDDEN, 3 * HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.out(context.transpose(1, 2).reshape(b, s, HIDDEN)), None


# Classes named as the detector's registries name Hugging Face's
ViTAttention = type("ViTAttention", (SelfAttention,), {})
SiglipAttention = type("SiglipAttention", (SelfAttention,), {})
InternVLVisionAttention = type("InternVLVisionAttention", (SelfAttention,), {})
LlamaAttention = type("LlamaAttention", (SelfAttention,), {})


def _init() -> tuple[int, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def _shard(num: int, rank: int, world: int) -> slice:
    """DeepSpeed's tests' split: the first ``num % world`` ranks hold one patch more."""
    base, extra = divmod(num, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _summed(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t)
    return t


def _vit_world(rank: int, world: int, has_cls: bool, num_patches: int) -> dict[str, float]:
    from dslaunch.sequence.autosp_vit import UlyssesSPViTAttention

    _init()
    torch.manual_seed(0)
    attn, head = SelfAttention(), int(has_cls)
    x = torch.randn(2, head + num_patches, HIDDEN)
    weight = torch.randn_like(x)  # the loss: sum(output * weight) over the whole sequence

    ref_x = x.clone().requires_grad_()
    ref_out, _ = attn(ref_x, None)
    (ref_out * weight).sum().backward()
    ref_grads = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()

    mine = _shard(num_patches, rank, world)
    rows = [*range(head), *range(head + mine.start, head + mine.stop)]
    local_x = x[:, rows].clone().requires_grad_()
    wrapped = UlyssesSPViTAttention(attn, None, has_cls_token=has_cls)
    out, extra = wrapped(local_x, None)
    # the replicated [CLS] row is counted once over the group
    scale = torch.tensor([1 / world] * head + [1.0] * (len(rows) - head)).view(1, -1, 1)
    (out * weight[:, rows] * scale).sum().backward()
    patch_grad = local_x.grad[:, head:]
    cls_grad = _summed(local_x.grad[:, :head])
    return {
        "out": float((out - ref_out[:, rows]).abs().max()),
        "extra_is_none": extra is None,
        "patch_grad": float((patch_grad - ref_x.grad[:, head + mine.start:head + mine.stop]).abs().max()),
        "cls_grad": float((cls_grad - ref_x.grad[:, :head]).abs().max()) if has_cls else 0.0,
        "weights": max(float((_summed(p.grad) - g).abs().max()) for p, g in zip(attn.parameters(), ref_grads,
                                                                               strict=True)),
        "scale": float(ref_x.grad.abs().max()),
    }


@pytest.mark.timeout(100)
@pytest.mark.parametrize(("has_cls", "num_patches"), [(True, 8), (False, 8), (True, 7), (False, 5)],
                         ids=["cls-even", "even", "cls-uneven", "uneven"])
def test_vit_attention_equals_one_process(has_cls: bool, num_patches: int) -> None:
    for got in run_world(_vit_world, 2, has_cls, num_patches, timeout=80):
        assert got["extra_is_none"]
        assert got["scale"] > 0.1
        for key in ("out", "patch_grad", "cls_grad", "weights"):
            assert got[key] < 1e-5, (key, got)


IMAGE = -200


def _llava_world(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from dslaunch.sequence.autosp_fusion import LlavaFusionAdapter

    _init()
    torch.manual_seed(1)
    projector = torch.nn.Linear(6, HIDDEN)
    visual = torch.randn(2, 5, 6)  # 5 visual tokens a sample: 3 on rank 0, 2 on rank 1
    text = torch.randn(2, 6, HIDDEN)
    ids = torch.arange(6).repeat(2, 1)
    ids[0, 1] = ids[1, 4] = IMAGE  # one image each, at different places

    ref_visual, ref_text = visual.clone().requires_grad_(), text.clone().requires_grad_()
    projected = projector(ref_visual)
    fused = torch.stack([torch.cat([ref_text[0, :1], projected[0], ref_text[0, 2:]]),
                         torch.cat([ref_text[1, :4], projected[1], ref_text[1, 5:]])])  # 10 positions
    weight = torch.randn(2, 10, HIDDEN)
    (fused * weight).sum().backward()
    ref_grads = [p.grad.clone() for p in projector.parameters()]
    projector.zero_grad()

    mine = _shard(5, rank, world)
    local_visual, local_text = visual[:, mine].clone().requires_grad_(), text.clone().requires_grad_()
    adapter = LlavaFusionAdapter(projector, None, image_token_id=IMAGE)
    part = adapter(local_visual, local_text, ids)
    (part * weight[:, rank * 5:(rank + 1) * 5]).sum().backward()
    parts = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(parts, part.detach())
    return {
        "shape": list(part.shape),
        "fused": float((torch.cat(parts, dim=1) - fused).abs().max()),
        "visual_grad": float((local_visual.grad - ref_visual.grad[:, mine]).abs().max()),
        "text_grad": float((_summed(local_text.grad) - ref_text.grad).abs().max()),
        "projector": max(float((_summed(p.grad) - g).abs().max()) for p, g in zip(projector.parameters(), ref_grads,
                                                                                 strict=True)),
    }


@pytest.mark.timeout(100)
def test_llava_fusion_round_trip_and_gradients() -> None:
    for got in run_world(_llava_world, 2, timeout=80):
        assert got["shape"] == [2, 5, HIDDEN]
        for key in ("fused", "visual_grad", "text_grad", "projector"):
            assert got[key] < 1e-5, (key, got)


class Layer(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)[0]


class Multimodal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = torch.nn.Sequential(Layer(ViTAttention()), Layer(ViTAttention()))
        self.siglip = Layer(SiglipAttention())
        self.internvl = Layer(InternVLVisionAttention())
        self.multi_modal_projector = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN))
        self.language_model = torch.nn.Sequential(Layer(LlamaAttention()))


def _wrap_world(rank: int, world: int) -> dict:
    from dslaunch.errors import UsageError
    from dslaunch.sequence.auto_sp import auto_wrap_model_for_sp
    from dslaunch.sequence.autosp_detector import detect_model_sp_info
    from dslaunch.sequence.autosp_vit import UlyssesSPViTAttention
    from dslaunch.utils.logging import logger

    _init()
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    model = Multimodal()
    info = detect_model_sp_info(model)
    assert auto_wrap_model_for_sp(model, None) is model
    wrapped = [model.vision[0].attn, model.vision[1].attn, model.siglip.attn, model.internvl.attn]
    first_lines = list(lines)
    auto_wrap_model_for_sp(model, None)  # again: nothing is wrapped twice
    lines.clear()
    llm_only = torch.nn.Sequential(Layer(LlamaAttention()))
    unchanged = auto_wrap_model_for_sp(llm_only, None) is llm_only and type(llm_only[0].attn) is LlamaAttention
    llm_lines = list(lines)
    try:
        auto_wrap_model_for_sp(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)
        refused = "accepted"
    except UsageError as err:
        refused = str(err)
    wrapper = model.vision[0].attn
    try:  # rank 1's hidden size differs: both ranks name the two shapes
        wrapper(torch.randn(1, 3, HIDDEN if rank == 0 else HIDDEN + 1))
        mismatch = "accepted"
    except UsageError as err:
        mismatch = str(err)
    try:  # rank 1's dtype differs (its shard is longer: that alone is fine)
        wrapper(torch.randn(1, 3 + rank, HIDDEN, dtype=torch.float32 if rank == 0 else torch.float64))
        dtype_mismatch = "accepted"
    except UsageError as err:
        dtype_mismatch = str(err)
    return {
        "found": ([n for n, _ in info.vit_attn_modules], [n for n, _ in info.llm_attn_modules],
                  info.vision_projection_module[0]),
        "types": [type(w).__name__ for w in wrapped],
        "cls": [w.has_cls_token for w in wrapped],
        "inner": [type(w.attn).__name__ for w in wrapped],
        "llm": type(model.language_model[0].attn).__name__,
        "same_after_second": all(a is b for a, b in zip(wrapped, [model.vision[0].attn, model.vision[1].attn,
                                                                  model.siglip.attn, model.internvl.attn],
                                                         strict=True)),
        "lines": first_lines,
        "unchanged": unchanged,
        "llm_lines": llm_lines,
        "refused": refused,
        "mismatch": mismatch,
        "dtype_mismatch": dtype_mismatch,
        "world_size": wrapper.world_size,
        "is_wrapper": isinstance(wrapper, UlyssesSPViTAttention),
    }


@pytest.mark.timeout(100)
def test_auto_wrap_wraps_vision_attention_and_reports_the_rest() -> None:
    for got in run_world(_wrap_world, 2, timeout=80):
        assert got["found"] == (["vision.0.attn", "vision.1.attn", "siglip.attn", "internvl.attn"],
                                ["language_model.0.attn"], "multi_modal_projector")
        assert got["types"] == ["UlyssesSPViTAttention"] * 4 and got["is_wrapper"] and got["world_size"] == 2
        assert got["cls"] == [True, True, False, True]  # ViT and transformers' InternVL have a [CLS] token, SigLIP none
        assert got["inner"] == ["ViTAttention", "ViTAttention", "SiglipAttention", "InternVLVisionAttention"]
        assert got["llm"] == "LlamaAttention" and got["same_after_second"]
        lines = got["lines"]
        assert any("1 language-model attention layer(s) (LlamaAttention: language_model.0.attn) left unwrapped"
                   in line for line in lines), lines
        assert any("vision projector 'multi_modal_projector' found" in line for line in lines), lines
        assert got["unchanged"] and len(got["llm_lines"]) == 2, got["llm_lines"]
        assert got["llm_lines"][1] == "AutoSP: nothing wrapped in Sequential; it is returned unchanged"
        assert got["refused"].startswith("auto_wrap_model_for_sp: no attention layer of a known class in Sequential;")
        assert "_VIT_ATTN_CLASSNAMES" in got["refused"]
        assert got["mismatch"].startswith("UlyssesSPViTAttention(ViTAttention): the ranks of the sequence group must "
                                          "hold shards of one dtype that differ only in the sequence dimension 1; "
                                          "rank 0 has (1, 2, 16), rank 1 has (1, 2, 17)"), got["mismatch"]
        assert got["dtype_mismatch"].endswith("rank 0 has (1, 2, 16), rank 1 has (1, 3, 16) (and another dtype)"), got


CONTEXT, START, END = 7, 8, 9


def _adapters_world(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dslaunch.errors import UsageError
    from dslaunch.sequence.autosp_fusion import (
        InternVLFusionAdapter,
        ModalityFusionSPAdapter,
        Qwen2VLFusionAdapter,
    )

    _init()
    torch.manual_seed(2)
    visual, text = torch.randn(1, 5, HIDDEN), torch.randn(1, 9, HIDDEN)
    mine = visual[:, _shard(5, rank, world)]  # 3 visual tokens on rank 0, 2 on rank 1
    internvl_ids = torch.tensor([[1, 2, *[CONTEXT] * 5, 3, 4]])
    qwen_ids = torch.tensor([[1, START, 0, 0, 0, 0, 0, END, 4]])
    expected = torch.cat([text[:, :2], visual, text[:, 7:]], dim=1)  # both put the 5 tokens at 2..6
    expected = F.pad(expected, (0, 0, 0, 1))  # 9 positions padded to 10, 5 a rank

    def whole(part: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part)
        return torch.cat(parts, dim=1)

    internvl = InternVLFusionAdapter(torch.nn.Identity(), None, image_token_id=CONTEXT)
    qwen = Qwen2VLFusionAdapter(torch.nn.Identity(), None, vision_start_token_id=START, vision_end_token_id=END)
    errors = {"internvl": float((whole(internvl(mine, text, internvl_ids)) - expected).abs().max()),
              "qwen": float((whole(qwen(mine, text, qwen_ids)) - expected).abs().max())}
    refusals = {}
    for name, call in {
        "too_few": lambda: internvl(mine, text, torch.tensor([[*[CONTEXT] * 6, 1, 2, 3]])),
        "unpaired": lambda: qwen(mine, text, torch.tensor([[1, END, 0, START, 0, 0, 0, 0, 4]])),
        "base": lambda: ModalityFusionSPAdapter(torch.nn.Identity(), None)(mine, text, internvl_ids),
    }.items():
        try:
            call()
            refusals[name] = "accepted"
        except (UsageError, NotImplementedError) as err:
            refusals[name] = f"{type(err).__name__}: {err}"
    return {**errors, **refusals}


@pytest.mark.timeout(100)
def test_internvl_and_qwen2vl_adapters_take_uneven_shards_and_refuse_bad_placeholders() -> None:
    for got in run_world(_adapters_world, 2, timeout=80):
        assert got["internvl"] < 1e-6 and got["qwen"] < 1e-6, got
        assert got["too_few"] == ("UsageError: InternVLFusionAdapter: sample 0 of input_ids has 6 IMG_CONTEXT tokens "
                                  "but the gathered visual features have 5 tokens, too few to give each its visual "
                                  "tokens"), got
        assert got["unpaired"].startswith("UsageError: Qwen2VLFusionAdapter: sample 0 of input_ids has vision_start "
                                          "tokens at [3] and vision_end tokens at [1]"), got
        assert got["base"].startswith("NotImplementedError: ModalityFusionSPAdapter._splice_visual_into_text"), got
