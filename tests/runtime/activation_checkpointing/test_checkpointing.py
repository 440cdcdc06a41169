"""``deepspeed.checkpointing`` in one process: gradients bit for bit those of the plain model
(dropout included: the RNG is replayed), ``None`` and non-tensor arguments, both checkpoints and
both modes, host-memory inputs without an mpu, ``configure``'s arguments and errors, the RNG
tracker."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import dslaunch
from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.activation_checkpointing import checkpointing as ckpt
from tests.runtime.activation_checkpointing.blocks import Stack, tokens

pytestmark = pytest.mark.timeout(60)

CHECKPOINTS = {"reentrant": ckpt.checkpoint, "non_reentrant": ckpt.non_reentrant_checkpoint}


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "_STATE", ckpt._State())


def _grads(model: Stack, seed: int = 5) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks
    model(tokens()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_the_module_is_deepspeeds() -> None:
    assert dslaunch.checkpointing.checkpoint is ckpt.checkpoint
    assert dslaunch.checkpointing.get_cuda_rng_tracker is ckpt.get_cuda_rng_tracker


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("which", list(CHECKPOINTS))
@pytest.mark.parametrize("in_cpu", [False, True], ids=["kept", "cpu"])
def test_gradients_are_bitwise_those_without_checkpointing(which: str, mode: str, in_cpu: bool) -> None:
    torch.manual_seed(0)
    model = Stack()
    plain = _grads(model)
    ckpt.configure(None, mode=mode, checkpoint_in_cpu=in_cpu)
    model.wrap = CHECKPOINTS[which]
    checked = _grads(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, checked, strict=True))
    model.wrap = None
    assert not all(torch.equal(a, b) for a, b in zip(plain, _grads(model, seed=6), strict=True))  # dropout on


@pytest.mark.parametrize("which", list(CHECKPOINTS))
def test_parameters_get_gradients_when_no_input_requires_grad(which: str) -> None:
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)  # torch's and DeepSpeed's reentrant checkpoints lose lin's gradient here
    CHECKPOINTS[which](lambda y, _none, k: lin(y) * k, x, None, 3).sum().backward()
    ref = copy.deepcopy(lin)
    (ref(x) * 3).sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("which", list(CHECKPOINTS))
def test_tuple_outputs_with_non_tensors_and_integer_tensors(which: str) -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y, n, idx = CHECKPOINTS[which](lambda a: (a.exp(), 7, a.argmax(1)), x)
    assert n == 7 and idx.dtype == torch.int64 and not idx.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_cpu_checkpointing_without_mpu_keeps_a_host_copy_of_the_inputs() -> None:
    """DeepSpeed moves only partitioned activations: without an mpu it keeps the input itself."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    ckpt.configure(None, checkpoint_in_cpu=True)
    h = x * 2
    y = ckpt.checkpoint(lambda a: (a @ w).tanh(), h)
    kept = y.grad_fn.call.kept[0]
    assert kept.data.device.type == "cpu" and kept.data.untyped_storage().data_ptr() != \
        h.untyped_storage().data_ptr() and kept.nbytes() == h.numel() * 4
    with torch.no_grad():
        h.zero_()  # the caller reuses its buffer: the copy is what the recompute reads
    y.sum().backward()
    expected = torch.autograd.grad(((x.detach() * 2) @ w).tanh().sum(), w)[0]
    assert torch.equal(w.grad, expected)


def test_the_cuda_rng_tracker_forks_named_states() -> None:
    tracker = ckpt.get_cuda_rng_tracker()
    tracker.add("a", 11)
    with pytest.raises(Exception, match="seed 11 already exists"):
        tracker.add("b", 11)
    with pytest.raises(Exception, match="cuda rng state a already exists"):
        tracker.add("a", 12)
    with pytest.raises(Exception, match="cuda rng state z is not added"):
        with tracker.fork("z"):
            pass
    torch.manual_seed(3)
    before = torch.get_rng_state()
    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream did not move
    assert torch.equal(first, torch.rand(3, generator=torch.Generator().manual_seed(11)))
    with tracker.fork("a"):
        assert not torch.equal(torch.rand(3), first)  # the named state advanced
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), first)
    tracker.reset()
    assert tracker.get_states() == {}


class _Mpu:
    def get_model_parallel_rank(self) -> int:
        return 1


def test_model_parallel_cuda_manual_seed_uses_deepspeeds_offsets() -> None:
    ckpt.configure(_Mpu())
    ckpt.model_parallel_cuda_manual_seed(100)
    assert torch.initial_seed() == 100
    with ckpt.get_cuda_rng_tracker().fork():
        drawn = torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(100 + 2718 + 1)))


def test_model_parallel_reconfigure_tp_seed_reseeds_only_the_tracker_state() -> None:
    ckpt.configure(_Mpu())
    ckpt.model_parallel_cuda_manual_seed(100)
    ckpt.model_parallel_reconfigure_tp_seed(5)
    default_next = torch.rand(3, generator=torch.Generator().manual_seed(100))
    with ckpt.get_cuda_rng_tracker().fork():
        drawn = torch.rand(4)
    assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(5 + 2718 + 1)))
    assert torch.equal(torch.rand(3), default_next)  # the default stream did not move


@pytest.mark.parametrize("which", list(CHECKPOINTS))
def test_dropout_under_the_tracker_is_replayed(which: str) -> None:
    ckpt.model_parallel_cuda_manual_seed(1)
    x = torch.randn(8, 8, requires_grad=True)

    def f(a: torch.Tensor) -> torch.Tensor:
        with ckpt.get_cuda_rng_tracker().fork():
            return torch.nn.functional.dropout(a.sin(), 0.5)

    states = ckpt.get_cuda_rng_tracker().get_states()
    f(x).sum().backward()
    plain, x.grad = x.grad, None
    ckpt.get_cuda_rng_tracker().set_states(states)
    CHECKPOINTS[which](f, x).sum().backward()
    assert torch.equal(plain, x.grad) and (plain == 0).any()


def test_configure_reads_the_block_and_arguments_win(tmp_path) -> None:
    assert not ckpt.is_configured()
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "activation_checkpointing": {
        "cpu_checkpointing": True, "number_checkpoints": 4, "profile": True, "mode": "selective"}}))
    ckpt.configure(None, deepspeed_config=str(path), profile=False)
    s = ckpt.settings()
    assert ckpt.is_configured() and s.cpu_checkpointing and s.num_layers == 4 and not s.profile
    assert s.mode == "selective"
    ckpt.set_num_layers(12)
    assert ckpt.settings().num_layers == 12


@pytest.mark.parametrize("kwargs, message", [
    ({"checkpoint_in_cpu": "yes"}, "'configure(checkpoint_in_cpu=)': must be true or false"),
    ({"num_checkpoints": 0}, "'configure(num_checkpoints=)': must be an integer"),
    ({"mode": "some"}, "'configure(mode=)': must be one of"),
    ({"contiguous_checkpointing": True, "num_checkpoints": 2}, "'configure(contiguous_checkpointing=)': "
     "needs partition_activations: true"),
    ({"deepspeed_config": {"activation_checkpointing": {"cpu_checkpoint": True}}},
     "'activation_checkpointing.cpu_checkpoint': unknown parameter for section 'activation_checkpointing' "
     "(did you mean 'cpu_checkpointing'?)"),
    ({"deepspeed_config": 3}, "configure(deepspeed_config=...) takes a ds_config path or dict"),
])
def test_bad_arguments_are_one_line_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        ckpt.configure(None, **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert not ckpt.is_configured()


def test_profile_counts_forwards_and_recomputes() -> None:
    ckpt.configure(None, profile=True)
    x = torch.randn(2, 2, requires_grad=True)
    for fn in CHECKPOINTS.values():
        fn(torch.sin, x).sum().backward()
    t = ckpt.profile_totals()
    assert (t.forwards, t.recomputes) == (2, 2) and t.recompute_s > 0
    ckpt.reset()
    assert ckpt.profile_totals().forwards == 0


def test_selective_refuses_a_kept_output_modified_in_place() -> None:
    ckpt.configure(None, mode="selective")
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    y = ckpt.checkpoint(lambda a: torch.relu_(a @ w).sum(), x)
    with pytest.raises(UsageError, match="modified in place"):
        y.backward()


def test_a_second_backward_through_a_non_reentrant_checkpoint_is_an_error() -> None:
    x = torch.randn(3, requires_grad=True)
    y = ckpt.non_reentrant_checkpoint(lambda a: a.exp().sum(), x)
    y.backward(retain_graph=True)
    with pytest.raises(UsageError, match="second time"):
        y.backward()


def test_a_recompute_that_takes_another_path_is_named() -> None:
    x = torch.randn(3, requires_grad=True)
    calls = []

    def f(a: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return a.exp() if len(calls) == 1 else a.exp().sin()  # the recompute saves more

    y = ckpt.non_reentrant_checkpoint(f, x)
    with pytest.raises(UsageError, match="the recompute saved 2 tensors for backward, the forward 1"):
        y.sum().backward()


@pytest.mark.parametrize("which", list(CHECKPOINTS))
def test_selective_keeps_dropout_masks_and_later_random_ops_draw_the_same(which: str) -> None:
    """Kept dropout draws are not drawn again in the recompute; a random op that is recomputed
    after them (``rand_like``) must still draw the forward's numbers."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 2, 4, 8, requires_grad=True)

    def f(a: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.dropout(a @ w, 0.3)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h, dropout_p=0.3)
        return h * torch.rand_like(h)

    torch.manual_seed(4)
    f(x).sum().backward()
    plain = [x.grad, w.grad]
    x.grad = w.grad = None
    ckpt.configure(None, mode="selective")
    torch.manual_seed(4)
    y = CHECKPOINTS[which](f, x)
    if which == "reentrant":  # masks kept: mm, dropout's draw, attention's bmm, its draw, bmm (CPU)
        assert [k.mask is not None for k in y.grad_fn.call.cache.kept] == [False, True, False, True, False]
    y.sum().backward()
    assert torch.equal(plain[0], x.grad) and torch.equal(plain[1], w.grad)
