"""``replace_transformer_layer`` / ``revert_transformer_layer`` / ``replace_module`` on a model of
BERT-shaped layers (Hugging Face's submodule names, plain torch: the real transformers model is
``test_transformer_inject_hf.py``): the replaced model computes the same loss and gradients, the
reverted one the same output; it trains at 2 gloo ranks under ZeRO-2 from ``deepspeed.initialize``
to the losses of the unreplaced model trained by plain torch on the whole batch (SGD with
momentum, 4 steps, within 1e-5 relative; not Adam, which turns the key bias's rounding-noise
gradient, zero in exact math, into full-size steps); with bf16 within 3e-2; and the refusals are one line."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.errors import ConfigError, NotInDslaunchError, UsageError
from dslaunch.kernels.transformer import DeepSpeedTransformerLayer
from dslaunch.kernels.transformer_config import DeepSpeedTransformerConfig
from dslaunch.module_inject import HFBertLayerPolicy, replace_transformer_layer, revert_transformer_layer
from dslaunch.module_inject.replace_module import replace_module
from tests.distributed import run_world

VOCAB, H, HEADS, INTER, LAYERS, SEQ = 50, 32, 4, 64, 2, 6


class Cfg:
    """The fields of a Hugging Face BertConfig that the layers and the replacement read."""

    hidden_size, num_attention_heads, intermediate_size, num_hidden_layers = H, HEADS, INTER, LAYERS
    hidden_dropout_prob = attention_probs_dropout_prob = 0.0
    initializer_range, layer_norm_eps = 0.02, 1e-12

    def __init__(self, act=lambda x: F.gelu(x, approximate="tanh")):
        self.act = act


class _Self(nn.Module):
    def __init__(self, cfg: Cfg):
        super().__init__()
        self.num_attention_heads = cfg.num_attention_heads
        self.query, self.key, self.value = (nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3))


class _Out(nn.Module):
    def __init__(self, fan_in: int, cfg: Cfg):
        super().__init__()
        self.dense = nn.Linear(fan_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class BertShapedLayer(nn.Module):
    """A Post-LN BERT layer with Hugging Face's submodule names."""

    def __init__(self, cfg: Cfg):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self, self.attention.output = _Self(cfg), _Out(cfg.hidden_size, cfg)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.intermediate.intermediate_act_fn = cfg.act
        self.output = _Out(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h = x.shape
        att = self.attention
        heads = att.self.num_attention_heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, heads, h // heads).transpose(1, 2)

        q, k, v = (split(m(x)) for m in (att.self.query, att.self.key, att.self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // heads) + (0 if mask is None else mask)
        ctx = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, h)
        a = att.output.LayerNorm(x + att.output.dense(ctx))
        return self.output.LayerNorm(a + self.output.dense(self.intermediate.intermediate_act_fn(
            self.intermediate.dense(a))))


class PreLNShapedLayer(nn.Module):
    """A Pre-LN BERT layer with the names of DeepSpeed's bing_bert example (``PreAttentionLayerNorm``,
    ``PostAttentionLayerNorm``, ``intermediate.dense_act``)."""

    def __init__(self, cfg: Cfg):
        super().__init__()
        self.attention = nn.Module()
        self.attention.self, self.attention.output = _Self(cfg), _Out(cfg.hidden_size, cfg)
        self.PreAttentionLayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.PostAttentionLayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Module()
        self.intermediate.dense_act = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = _Out(cfg.intermediate_size, cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h = x.shape
        att = self.attention
        heads = att.self.num_attention_heads
        y = self.PreAttentionLayerNorm(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, heads, h // heads).transpose(1, 2)

        q, k, v = (split(m(y)) for m in (att.self.query, att.self.key, att.self.value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // heads) + (0 if mask is None else mask)
        a = x + att.output.dense((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, h))
        ff = F.gelu(self.intermediate.dense_act(self.PostAttentionLayerNorm(a)), approximate="tanh")
        return a + self.output.dense(ff)


class TinyBert(nn.Module):
    """Embeddings, BERT-shaped layers, a token head; ``forward(tokens, labels)`` is the loss."""

    def __init__(self, cfg: Cfg, layer: type = BertShapedLayer):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(layer(cfg) for _ in range(LAYERS))
        self.head = nn.Linear(H, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        mask = pad.float()[:, None, None, :] * -10000.0
        x = self.embed(tokens)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _model(cfg: Cfg | None = None, layer: type = BertShapedLayer) -> TinyBert:
    torch.manual_seed(0)
    model = TinyBert(cfg or Cfg(), layer)
    with torch.no_grad():  # non-trivial norms, so a LayerNorm copied to the wrong slot shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _batch(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    tokens[::2, -2:] = 0  # padding, masked out
    return tokens, torch.randint(0, VOCAB, (n, SEQ), generator=g)


def _grads_by_ds_name(model: TinyBert) -> dict[str, torch.Tensor]:
    out = {}
    for i, layer in enumerate(model.encoder.layer):
        for name, tensors in HFBertLayerPolicy(layer).parameter_map().items():
            out[f"{i}.{name}"] = torch.cat([t.grad for t in tensors])
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("layer_cls", [BertShapedLayer, PreLNShapedLayer])
def test_replaced_model_has_the_same_loss_and_gradients_and_reverts(layer_cls: type) -> None:
    pre_ln = layer_cls is PreLNShapedLayer
    ref = _model(layer=layer_cls)
    model = replace_transformer_layer(orig_layer_impl=layer_cls, model=copy.deepcopy(ref), micro_batch_size=4,
                                      bert_config=Cfg(), seed=1, preln=pre_ln, fp16=False, huggingface=False)
    layers = list(model.encoder.layer)
    assert all(type(layer) is DeepSpeedTransformerLayer for layer in layers)
    assert layers[0].config.pre_layer_norm == pre_ln and layers[0].config.intermediate_size == INTER
    tokens, labels = _batch(4)
    loss, ref_loss = model(tokens, labels), ref(tokens, labels)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad, rtol=1e-5, atol=1e-7)
    for key, grad in _grads_by_ds_name(ref).items():
        i, name = key.split(".")
        torch.testing.assert_close(getattr(layers[int(i)], name).grad, grad, rtol=1e-5, atol=1e-7, msg=key)
    back = revert_transformer_layer(layer_cls, model, Cfg(), preln=pre_ln)
    assert all(type(layer) is layer_cls for layer in back.encoder.layer)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, labels), ref_loss.detach(), rtol=1e-6, atol=0)


@pytest.mark.timeout(30)
def test_config_settings_and_refusals() -> None:
    with pytest.raises(ConfigError, match="pre_layer_norm.*True does not match.*pass pre_layer_norm=False"):
        replace_transformer_layer(BertShapedLayer, _model(), None, DeepSpeedTransformerConfig(
            attn_dropout_ratio=0.1, hidden_dropout_ratio=0.2))
    cfg = DeepSpeedTransformerConfig(attn_dropout_ratio=0.1, hidden_dropout_ratio=0.2, gelu_checkpoint=True,
                                     pre_layer_norm=False)
    model = replace_transformer_layer(BertShapedLayer, _model(), None, cfg)
    layer = model.encoder.layer[1]
    assert (layer.config.hidden_dropout_ratio, layer.config.gelu_checkpoint, layer.config.heads) == (0.2, True, HEADS)
    with pytest.raises(ConfigError, match=r"hidden_size.*64.*does not match the model's layer \(32\)"):
        replace_transformer_layer(BertShapedLayer, _model(), config=dataclasses_replace(cfg, hidden_size=64, heads=4))
    with pytest.raises(ConfigError, match="preln=True but BertShapedLayer is Post-LN"):
        replace_transformer_layer(orig_layer_impl=BertShapedLayer, model=_model(), micro_batch_size=4,
                                  bert_config=Cfg(), seed=1, preln=True, fp16=False, huggingface=True)
    with pytest.raises(ConfigError, match="not GeLU"):
        replace_transformer_layer(BertShapedLayer, _model(Cfg(act=torch.relu)), model_config=Cfg(torch.relu))
    with pytest.raises(ConfigError, match="model_config"):
        replace_transformer_layer(BertShapedLayer, _model())
    with pytest.raises(NotInDslaunchError, match="init_inference"):
        replace_transformer_layer(BertShapedLayer, _model(), None, {"replace_with_kernel_inject": True}, Cfg())
    with pytest.raises(UsageError, match="load the state dict"):
        replace_module(_model(), BertShapedLayer, lambda c, p, i: c, None, checkpoint="x.pt")


def dataclasses_replace(cfg: DeepSpeedTransformerConfig, **kw) -> DeepSpeedTransformerConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.timeout(30)
def test_replace_module_passes_what_replace_fn_takes() -> None:
    seen: list[tuple] = []

    def with_prefix(child, policy, layer_id, prefix=None, state_dict=None):
        seen.append((layer_id, prefix, policy))
        return nn.Identity()

    model = replace_module(_model(), BertShapedLayer, with_prefix, "P")
    assert seen == [(0, "encoder.layer.0", "P"), (1, "encoder.layer.1", "P")]
    assert all(isinstance(m, nn.Identity) for m in model.encoder.layer)
    ids = []
    replace_module(_model(), BertShapedLayer, lambda c, p, i: ids.append(i) or c, None)
    assert ids == [0, 1]


LR, MOMENTUM, STEPS, GLOBAL = 0.2, 0.5, 4, 4  # no clipping (DeepSpeed clips at 1.0 by default)


def _zero2(rank: int, world: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    import dslaunch

    results = {}
    for precision in ("fp32", "bf16"):
        model = replace_transformer_layer(BertShapedLayer, _model(), model_config=Cfg())
        engine, _, _, _ = dslaunch.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            config={"train_batch_size": GLOBAL, "zero_optimization": {"stage": 2, "reduce_bucket_size": 500},
                    "bf16": {"enabled": precision == "bf16"}, "zero_allow_untested_optimizer": True,
                    "gradient_clipping": 0.0, "steps_per_print": 1000})
        micro = GLOBAL // world
        losses = []
        for step in range(STEPS):
            tokens, labels = _batch(GLOBAL, seed=step)
            loss = engine(tokens[rank * micro:(rank + 1) * micro], labels[rank * micro:(rank + 1) * micro])
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
        results[precision] = losses
    return results


@pytest.mark.timeout(90)
def test_trains_under_zero2_at_two_ranks_as_the_unreplaced_model() -> None:
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    want = []
    for step in range(STEPS):
        loss = ref(*_batch(GLOBAL, seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert want[-1] < want[0]
    for got in run_world(_zero2, 2):
        for precision, rtol in (("fp32", 1e-5), ("bf16", 3e-2)):  # bf16: the layer's 16-bit math
            for g, w in zip(got[precision], want, strict=True):
                assert abs(g - w) <= rtol * abs(w), (precision, got, want)
