"""Domino (``deepspeed.runtime.domino``) on 2 gloo ranks of tensor parallelism: its output and every
gradient equal those of the same transformer computed whole on one rank (weights gathered from the
shards, batch unsplit), in both overlap orders, pre-LN and post-LN residuals, with a rotary
function; the backward leaves no all-reduce unwaited; bad use gets one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from tests.distributed import run_world

S, B, H, HEADS, HEAD_DIM, FFN, LAYERS = 5, 4, 8, 4, 2, 16, 2
TOL = dict(atol=2e-5, rtol=1e-4)


def _config(intra: bool, post: bool, **changed) -> SimpleNamespace:
    def init(w: torch.Tensor) -> None:
        torch.nn.init.normal_(w, std=0.3)

    fields = dict(hidden_size=H, num_attention_heads=HEADS, kv_channels=HEAD_DIM, ffn_hidden_size=FFN,
                  num_layers=LAYERS, params_dtype=torch.float32, perform_initialization=True, init_method=init,
                  output_layer_init_method=init, add_bias_linear=True, attention_dropout=0.0, hidden_dropout=0.0,
                  layernorm_epsilon=1e-5, apply_residual_connection_post_layernorm=post, gated_linear_unit=False,
                  domino_intra_layer_overlap=intra)
    return SimpleNamespace(**{**fields, **changed})


class _Mpu:
    def get_tensor_model_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    def get_tensor_model_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD


def _rotary(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    return t * freqs  # any position-dependent function of [b, np, s, hn] serves the comparison


def _gathered(t: torch.Tensor, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim=dim)


# (module path, concatenation dim of its shards; None: replicated)
SHARDS = {"self_attention.query_key_value.weight": 0, "self_attention.query_key_value.bias": 0,
          "self_attention.dense.weight": 1, "self_attention.dense.bias": None,
          "linear_fc1.weight": 0, "linear_fc1.bias": 0, "linear_fc2.weight": 1, "linear_fc2.bias": None,
          "input_layernorm.weight": None, "input_layernorm.bias": None,
          "post_attention_layernorm.weight": None, "post_attention_layernorm.bias": None}


def _whole_layer(x: torch.Tensor, p: dict[str, torch.Tensor], post: bool, freqs: torch.Tensor | None) -> torch.Tensor:
    """One layer of the same model without tensor parallelism (the reference)."""
    ln1 = F.layer_norm(x, (H,), p["input_layernorm.weight"], p["input_layernorm.bias"], 1e-5)
    qkv = F.linear(ln1, p["self_attention.query_key_value.weight"], p["self_attention.query_key_value.bias"])
    q, k, v = qkv.view(S, B, HEADS, 3 * HEAD_DIM).permute(1, 2, 0, 3).split(HEAD_DIM, dim=3)
    if freqs is not None:
        q, k = _rotary(q, freqs), _rotary(k, freqs)
    ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = F.linear(ctx.permute(2, 0, 1, 3).reshape(S, B, HEADS * HEAD_DIM), p["self_attention.dense.weight"],
                    p["self_attention.dense.bias"])
    x2 = attn + (ln1 if post else x)
    ln2 = F.layer_norm(x2, (H,), p["post_attention_layernorm.weight"], p["post_attention_layernorm.bias"], 1e-5)
    mlp = F.linear(F.gelu(F.linear(ln2, p["linear_fc1.weight"], p["linear_fc1.bias"])), p["linear_fc2.weight"],
                   p["linear_fc2.bias"])
    return mlp + (ln2 if post else x2)


def _whole_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of the model whole (shards gathered), as leaves of their own."""
    def dim(name: str) -> int | None:
        return SHARDS.get(name.split(".", 2)[-1])

    return {n: (_gathered(p, dim(n)) if dim(n) is not None else p.detach().clone()).requires_grad_()
            for n, p in model.named_parameters()}


def _whole_model(x: torch.Tensor, whole: dict[str, torch.Tensor], post: bool,
                 freqs: torch.Tensor | None) -> torch.Tensor:
    h = x
    for i in range(LAYERS):
        h = _whole_layer(h, {k.split(".", 2)[-1]: v for k, v in whole.items() if k.startswith(f"layers.{i}.")},
                         post, freqs)
    return F.layer_norm(h, (H,), whole["final_layernorm.weight"], whole["final_layernorm.bias"], 1e-5)


def _compare(rank: int, world: int, intra: bool, post: bool) -> None:
    import torch.distributed as dist

    from dslaunch.runtime.domino.transformer import DominoTransformer, ModelType

    torch.manual_seed(100 + rank)  # each rank's shards differ
    model = DominoTransformer(_config(intra, post), _Mpu(), _rotary, ModelType.encoder_or_decoder)
    torch.manual_seed(7)  # replicated: LayerNorms and row-parallel biases; column-parallel biases per rank
    for name, param in model.named_parameters():
        with torch.no_grad():
            shard = SHARDS.get(name.split(".", 2)[-1], None)
            if name.endswith("bias") or "layernorm" in name:
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm.weight" in name else 0.0))
                if shard == 0:
                    param.add_(rank * 0.1)
    x = torch.randn(S, B, H, requires_grad=True)
    freqs = torch.rand(S, HEAD_DIM) + 0.5
    weights = torch.randn(S, B, H)
    out = model(x, None, freqs)
    (out * weights).sum().backward()
    assert all(h is None for layer in model.layers for h in layer.handles.values())

    whole = _whole_parameters(model)
    x_ref = x.detach().clone().requires_grad_()
    ref = _whole_model(x_ref, whole, post, freqs)
    (ref * weights).sum().backward()

    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    for name, param in model.named_parameters():
        dim = SHARDS.get(name.split(".", 2)[-1])
        expected = whole[name].grad if dim is None else whole[name].grad.chunk(world, dim=dim)[rank]
        torch.testing.assert_close(param.grad, expected, **TOL, msg=lambda m, n=name: f"{n}: {m}")

    with pytest.raises(UsageError, match="at least 2"):
        model(torch.randn(S, 1, H), None)
    dist.barrier()


def _variants(rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for intra, post in ((False, False), (True, False), (False, True)):
        _compare(rank, world, intra, post)


@pytest.mark.timeout(120)
def test_domino_equals_the_whole_transformer_in_both_orders_and_residual_kinds() -> None:
    run_world(_variants, 2)


@pytest.mark.timeout(30)
def test_a_config_without_a_field_or_with_an_unsplittable_size_is_one_line() -> None:
    from dslaunch.runtime.domino.transformer import AttnMaskType, CoreAttention, ShardedAttention

    class OneRank(_Mpu):
        def get_tensor_model_parallel_world_size(self) -> int:
            return 3

        def get_tensor_model_parallel_group(self):
            return None

    config = _config(False, False)
    del config.kv_channels
    with pytest.raises(UsageError, match="has no 'kv_channels'"):
        ShardedAttention(config, OneRank(), None, 1)
    with pytest.raises(UsageError, match=r"num_attention_heads \(4\) must be a multiple of the tensor-parallel size \(3\)"):
        ShardedAttention(_config(False, False), OneRank(), None, 1)
    with pytest.raises(UsageError, match="causal"):
        CoreAttention(_config(False, False), 1, AttnMaskType.padding)


class _FullMpu(_Mpu):
    """Megatron's mpu for tensor-parallel 2 x data-parallel 1."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.singles = [dist.new_group([r]) for r in range(dist.get_world_size())]

    def get_data_parallel_group(self):
        import torch.distributed as dist

        return self.singles[dist.get_rank()]

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_tensor_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    get_model_parallel_group = _Mpu.get_tensor_model_parallel_group
    get_model_parallel_world_size = _Mpu.get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank


def _engine_steps(rank: int, world: int, stage: int) -> None:
    import torch.distributed as dist

    import dslaunch as deepspeed
    from dslaunch.runtime.domino.transformer import DominoTransformer, ModelType

    dist.init_process_group("gloo")
    torch.manual_seed(100 + rank)
    model = DominoTransformer(_config(False, False), _Mpu(), None, ModelType.encoder_or_decoder)
    whole = _whole_parameters(model)
    reference = torch.optim.SGD(whole.values(), lr=0.1)
    torch.manual_seed(3)
    data = [torch.randn(S, B, H) for _ in range(3)]
    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, mpu=_FullMpu())
    losses, expected = [], []
    for x in data:
        loss = engine(x, None).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_loss = _whole_model(x, whole, False, None).pow(2).mean()
        ref_loss.backward()
        reference.step()
        reference.zero_grad()
        losses.append(loss.item())
        expected.append(ref_loss.item())
    assert expected[-1] < expected[0]
    torch.testing.assert_close(losses, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_domino_trains_from_deepspeed_initialize_with_megatrons_mpu_as_the_whole_model(stage: int) -> None:
    run_world(_engine_steps, 2, stage)
