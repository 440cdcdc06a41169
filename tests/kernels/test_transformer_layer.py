"""``DeepSpeedTransformerLayer`` against a plain-torch BERT layer (``bert_reference.py``), as
DeepSpeed's ``unit/ops/accelerators/test_accelerator_forward.py``/``backward.py`` check its CUDA
layer against ``modeling.py``/``modelingpreln.py``: a stack of layers sharing weights with the
reference, Pre-LN and Post-LN, an additive ``[batch, 1, 1, seq]`` mask, output and every gradient
(DeepSpeed's tolerances are 1e-2..2e-1 for its fp16 kernels; the fp32 math here agrees to 1e-5).
Also: boolean/None/``[b, 1, s, s]`` masks, the memory savers (same results, fewer bytes saved for
backward), fp16/bf16, dropout, the initialization, DeepSpeed's ``initial_weights`` and ``grads``
test hooks, and the config's one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dslaunch.errors import ConfigError, UsageError
from dslaunch.kernels.transformer import DeepSpeedTransformerLayer
from dslaunch.kernels.transformer_config import DeepSpeedTransformerConfig
from tests.kernels.bert_reference import ReferenceBertLayer

B, S, H, HEADS, INTER = 3, 7, 32, 4, 48


def _config(**kw) -> DeepSpeedTransformerConfig:
    base = dict(batch_size=B, hidden_size=H, intermediate_size=INTER, heads=HEADS, attn_dropout_ratio=0.0,
                hidden_dropout_ratio=0.0, num_hidden_layers=3, initializer_range=0.02)
    return DeepSpeedTransformerConfig(**{**base, **kw})


def _layers(n: int, **kw) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(DeepSpeedTransformerLayer(_config(**kw)) for _ in range(n))
    with torch.no_grad():  # non-trivial biases and norms, so a swapped parameter shows
        for layer in layers:
            for p in layer.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return layers


def _run(stack, x, mask):
    x = x.clone().requires_grad_()
    y = x
    for layer in stack:
        y = layer(y, mask)
    torch.manual_seed(1)
    (y * torch.randn_like(y)).sum().backward()
    return y.detach(), x.grad


def _masks() -> dict[str, torch.Tensor | None]:
    torch.manual_seed(2)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[0, 4:] = False
    pad[2, 6:] = False
    return {"random_additive": torch.randn(B, 1, 1, S),  # what DeepSpeed's test feeds
            "padding_additive": (~pad).float()[:, None, None, :] * -10000.0,
            "bool": pad[:, None, None, :], "none": None, "per_query": torch.randn(B, 1, S, S)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pre_ln", [True, False])
@pytest.mark.parametrize("mask_kind", ["random_additive", "padding_additive", "bool", "none", "per_query"])
def test_forward_and_backward_equal_the_reference(pre_ln: bool, mask_kind: str) -> None:
    stack = _layers(3, pre_layer_norm=pre_ln)
    refs = torch.nn.ModuleList(ReferenceBertLayer.copy_of(layer) for layer in stack)
    mask = _masks()[mask_kind]
    ref_mask = None if mask is None else (mask.float().masked_fill(~mask, torch.finfo(torch.float32).min).masked_fill(
        mask, 0.0) if mask.dtype == torch.bool else mask)
    x = torch.randn(B, S, H)
    out, dx = _run(stack, x, mask)
    ref_out, ref_dx = _run(refs, x, ref_mask)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
    for layer, ref in zip(stack, refs, strict=True):
        for name, grad in ref.grads_as_ds().items():
            torch.testing.assert_close(getattr(layer, name).grad, grad, rtol=1e-4, atol=1e-5, msg=name)


def _saved_bytes(stack, x, mask) -> int:
    """Bytes of the distinct storages autograd keeps for backward of one forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x.clone().requires_grad_()
        for layer in stack:
            y = layer(y, mask)
    params = {p.untyped_storage().data_ptr() for p in stack.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pre_ln", [True, False])
@pytest.mark.parametrize("saver", ["gelu_checkpoint", "attn_dropout_checkpoint", "normalize_invertible"])
def test_memory_savers_keep_the_results_and_save_less(pre_ln: bool, saver: str) -> None:
    dropout = dict(attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1)
    plain, saving = _layers(2, pre_layer_norm=pre_ln, **dropout), _layers(2, pre_layer_norm=pre_ln, **dropout,
                                                                           **{saver: True})
    x, mask = torch.randn(B, S, H), _masks()["padding_additive"]
    torch.manual_seed(5)
    out, dx = _run(plain, x, mask)
    torch.manual_seed(5)  # the same dropout masks: a checkpointed region replays its RNG state
    out2, dx2 = _run(saving, x, mask)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx2, dx, rtol=1e-4, atol=1e-5)
    for a, b in zip(plain.parameters(), saving.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    assert _saved_bytes(saving, x, mask) < _saved_bytes(plain, x, mask)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("pre_ln", [True, False])
def test_half_precision_follows_fp32(dtype: torch.dtype, tol: float, pre_ln: bool) -> None:
    stack = _layers(2, pre_layer_norm=pre_ln, fp16=dtype == torch.float16)
    half = _layers(2, pre_layer_norm=pre_ln).to(dtype)
    x, mask = torch.randn(B, S, H), _masks()["padding_additive"]
    out, dx = _run(stack, x, mask)
    out_h, dx_h = _run(half, x.to(dtype), mask.to(dtype))
    assert out_h.dtype == dtype and dx_h.dtype == dtype
    scale = out.abs().max()
    assert (out_h.float() - out).abs().max() < tol * scale
    assert (dx_h.float() - dx).abs().max() < tol * dx.abs().max()
    for a, b in zip(stack.parameters(), half.parameters(), strict=True):
        assert b.grad.dtype == dtype and (b.grad.float() - a.grad).abs().max() <= 2 * tol * a.grad.abs().max() + 1e-6


@pytest.mark.timeout(30)
def test_dropout_only_in_training() -> None:
    layer = _layers(1, attn_dropout_ratio=0.3, hidden_dropout_ratio=0.3)[0]
    x = torch.randn(B, S, H)
    a, b = layer(x), layer(x)
    assert not torch.equal(a, b)
    layer.eval()
    ref = ReferenceBertLayer.copy_of(layer)
    torch.testing.assert_close(layer(x), ref(x), rtol=1e-5, atol=1e-5)
    starts_eval = DeepSpeedTransformerLayer(_config(training=False))
    assert not starts_eval.training


@pytest.mark.timeout(30)
@pytest.mark.parametrize("adjust", [True, False])
def test_initialization_as_deepspeed(adjust: bool) -> None:
    torch.manual_seed(0)
    cfg = DeepSpeedTransformerConfig(hidden_size=256, heads=4, attn_dropout_ratio=0.1, hidden_dropout_ratio=0.1,
                                     num_hidden_layers=8, initializer_range=0.02, adjust_init_range=adjust)
    layer = DeepSpeedTransformerLayer(cfg)
    assert cfg.intermediate_size == 1024 and layer.inter_w.shape == (1024, 256) and layer.attn_qkvw.shape == (768, 256)
    out_std = 0.02 / (2 * 8) ** 0.5 if adjust else 0.02
    for name, std in (("attn_qkvw", 0.02), ("inter_w", 0.02), ("attn_ow", out_std), ("output_w", out_std)):
        assert abs(getattr(layer, name).std().item() - std) < 0.03 * std, name
    for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
        assert torch.count_nonzero(getattr(layer, name)) == 0
    assert torch.all(layer.attn_nw == 1) and torch.all(layer.norm_w == 1)


@pytest.mark.timeout(30)
def test_initial_weights_and_grads_hooks_as_deepspeeds_tests_use_them() -> None:
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(H, H) * 0.02) for _ in range(4)]
    weights += [torch.nn.Parameter(torch.ones(H)), torch.nn.Parameter(torch.randn(INTER, H) * 0.02),
                torch.nn.Parameter(torch.randn(H, INTER) * 0.02), torch.nn.Parameter(torch.ones(H))]
    biases = [torch.nn.Parameter(torch.zeros(n)) for n in (H, H, H, H, H, INTER, H, H)]
    layer = DeepSpeedTransformerLayer(_config(), weights, biases)
    assert layer.attn_ow is weights[3] and layer.norm_b is biases[7] and torch.count_nonzero(layer.attn_qkvb) == 0
    torch.testing.assert_close(layer.attn_qkvw[2 * H:], weights[2])
    grads: list = []
    y = layer(torch.randn(B, S, H), torch.zeros(B, 1, 1, S), grads=grads)
    y.pow(2).sum().backward()
    names = sorted(name for _, name in grads)
    assert names == sorted(["V_W", "V_B", "O_W", "O_B", "N2_W", "N2_B", "int_W", "int_B", "out_W", "out_B",
                            "norm_W", "norm_B"])
    by_name = {name: g for g, name in grads}
    torch.testing.assert_close(by_name["V_W"], layer.attn_qkvw.grad[2 * H:])
    torch.testing.assert_close(by_name["out_W"], layer.output_w.grad)
    grads.clear()
    layer(torch.randn(B, S, H)).sum().backward()  # no grads list: the earlier hooks are gone
    assert grads == []


@pytest.mark.timeout(30)
def test_outputs_ids_and_refused_arguments() -> None:
    first = DeepSpeedTransformerLayer(_config(return_tuple=True))
    second = DeepSpeedTransformerLayer(_config())
    assert second.layer_id == first.layer_id + 1 == DeepSpeedTransformerLayer.layer_id - 1
    x = torch.randn(B, S, H)
    out = first(x)
    assert isinstance(out, tuple) and len(out) == 1 and out[0].shape == x.shape
    assert isinstance(second(x, past_key_values=None, output_attentions=True), torch.Tensor)
    with pytest.raises(UsageError, match="encoder_hidden_states is not supported"):
        second(x, None, None, None, x)
    with pytest.raises(UsageError, match="head_mask"):
        second(x, head_mask=torch.ones(HEADS))


def test_config_defaults_and_errors(tmp_path) -> None:
    blank = DeepSpeedTransformerConfig()
    assert (blank.hidden_size, blank.intermediate_size, blank.layer_norm_eps, blank.pre_layer_norm) == (-1, -1, 1e-12,
                                                                                                       True)
    assert DeepSpeedTransformerConfig(hidden_size=64).intermediate_size == 256
    with pytest.raises(ConfigError, match=r"DeepSpeedTransformerConfig.heads.*divisor of hidden_size \(30\)"):
        DeepSpeedTransformerConfig(hidden_size=30, heads=4)
    with pytest.raises(ConfigError, match=r"attn_dropout_ratio.*\[0, 1\)"):
        DeepSpeedTransformerConfig(attn_dropout_ratio=1.5)
    with pytest.raises(ConfigError, match=r"fp16.*true or false"):
        DeepSpeedTransformerConfig(fp16="yes")
    with pytest.raises(ConfigError, match="hidden_size.*not given"):
        DeepSpeedTransformerLayer(blank)
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        DeepSpeedTransformerConfig.from_dict({"hiden_size": 8})
    dumped = {**dataclasses.asdict(DeepSpeedTransformerConfig(hidden_size=8, heads=2)), "layer_id": 3,
              "test_gemm": False, "is_grad_enabled": True}  # DeepSpeed's config.__dict__
    assert DeepSpeedTransformerConfig.from_dict(dumped) == DeepSpeedTransformerConfig(hidden_size=8, heads=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        blank.hidden_size = 8
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"hidden_size": 16, "heads": 2, "pre_layer_norm": False}), encoding="utf-16")
    loaded = DeepSpeedTransformerConfig.from_json_file(path)
    assert (loaded.hidden_size, loaded.heads, loaded.pre_layer_norm, loaded.intermediate_size) == (16, 2, False, 64)
    path.write_text("[1]")
    with pytest.raises(ConfigError, match="cfg.json: expected a JSON object"):
        DeepSpeedTransformerConfig.from_json_file(path)


def test_deepspeed_import_paths() -> None:
    import dslaunch
    from dslaunch.ops.transformer import DeepSpeedTransformerConfig as Config
    from dslaunch.ops.transformer import DeepSpeedTransformerLayer as Layer

    assert dslaunch.DeepSpeedTransformerLayer is Layer is DeepSpeedTransformerLayer
    assert dslaunch.DeepSpeedTransformerConfig is Config is DeepSpeedTransformerConfig
    assert dslaunch.ops.DeepSpeedTransformerLayer is Layer and dslaunch.ops.DeepSpeedTransformerConfig is Config


_DEEPSPEED_SIDE = """
import inspect, json
from deepspeed.ops.transformer.transformer import DeepSpeedTransformerConfig as C
sig = {n: p.default for n, p in inspect.signature(C.__init__).parameters.items() if n != "self"}
cases = [{}, {"hidden_size": 64, "heads": 4}, {"hidden_size": 64, "intermediate_size": 100, "pre_layer_norm": False}]
print("DS " + json.dumps({"signature": sig, "configs": [C(**kw).__dict__ for kw in cases]}))
"""


@pytest.mark.timeout(120)
def test_config_arguments_defaults_and_fields_equal_real_deepspeeds(deepspeed_python) -> None:
    """Real DeepSpeed 0.19.8 (``DSLAUNCH_DEEPSPEED_PYTHON``, or the conformance venv): the same
    constructor arguments in the same order with the same defaults, and the same field values."""
    import inspect
    import os

    from tests.deepspeed_reference import run_python

    proc = run_python(deepspeed_python, ["-c", _DEEPSPEED_SIDE], {**os.environ, "DS_ACCELERATOR": "cpu",
                                                                 "OMP_NUM_THREADS": "1"}, timeout=110)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("DS ")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    theirs = json.loads(line[3:])
    ours = {n: p.default for n, p in inspect.signature(DeepSpeedTransformerConfig).parameters.items()}
    assert list(ours.items()) == list(theirs["signature"].items())
    cases = [{}, {"hidden_size": 64, "heads": 4}, {"hidden_size": 64, "intermediate_size": 100, "pre_layer_norm": False}]
    for kw, fields in zip(cases, theirs["configs"], strict=True):
        state = {k: fields.pop(k) for k in ("layer_id", "test_gemm", "is_grad_enabled")}
        assert state["layer_id"] == -1
        if "hidden_size" not in kw:  # DeepSpeed's 4 * hidden_size of an unset hidden size; dslaunch keeps -1
            assert fields["intermediate_size"] == -4
            fields["intermediate_size"] = -1
        assert dataclasses.asdict(DeepSpeedTransformerConfig(**kw)) == fields, kw
        assert DeepSpeedTransformerConfig.from_dict({**fields, **state}) == DeepSpeedTransformerConfig(**kw)
