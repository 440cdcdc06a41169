"""DeepSpeed's zero API on gloo ranks: ``zero.Init``, ``GatheredParameters``, external parameters,
``ZeroParamStatus`` and ``safe_get_full_*``; stage 3 with a tied weight, a module called twice, a
parameter read outside its module and evaluation under ``torch.no_grad()``, against plain torch."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model
from tests.runtime.zero.equivalence import STEPS, assert_close, config, engine_losses

V, D = 12, 8


class Tied(torch.nn.Module):
    """Embedding tied to the head, ``mid`` called twice, ``mid.weight`` also read by the root."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.mid = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight
        self.gain = torch.nn.Parameter(torch.ones(D))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(tokens)))
        h = torch.tanh(self.mid(h)) * self.gain
        h = h + 0.1 * torch.nn.functional.linear(h, self.mid.weight)  # outside its module
        return torch.nn.functional.cross_entropy(self.head(h.mean(1)), labels)


def _tied(external: bool) -> Tied:
    import dslaunch.zero

    torch.manual_seed(3)
    model = Tied()
    if external:
        dslaunch.zero.register_external_parameter(model, model.mid.weight)
    return model


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4,), generator=g))
            for _ in range(steps)]


def _tied_run(rank: int, world: int, stage: int) -> None:
    import dslaunch
    from dslaunch.runtime.zero.partition_parameters import ZeroParamStatus
    from dslaunch.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state

    ref = _tied(external=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    cfg = {"train_batch_size": 4, "steps_per_print": 1000, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "reduce_bucket_size": 40}}
    model = _tied(external=True)
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    seen: list[set[str]] = []
    names = {id(p): n for n, p in model.named_parameters()}
    model.mid.register_forward_pre_hook(lambda m, a: seen.append(
        {names[id(p)] for p in model.parameters() if p.numel()}))
    micro = 4 // world
    for tokens, labels in _data(4):
        ref_loss = ref(tokens, labels)
        ref_loss.backward()
        loss = engine(tokens[rank * micro:(rank + 1) * micro], labels[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(safe_get_full_grad(p), q.grad, rtol=1e-5, atol=1e-6, msg=n)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        engine.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), rtol=1e-5, atol=2e-6, msg=n)
            torch.testing.assert_close(safe_get_full_optimizer_state(p, "exp_avg"), opt.state[q]["exp_avg"],
                                       rtol=1e-5, atol=1e-7, msg=n)
    if stage == 3:
        # root holds gain + the external mid.weight; mid adds its own: nothing of embed/head
        assert seen[0] == {"gain", "mid.weight", "mid.bias"}, seen[0]
        assert all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0
                   for p in model.parameters()), "parameters left whole after backward"
    engine.eval()
    tokens, labels = _data(5)[-1]
    with torch.no_grad():
        torch.testing.assert_close(engine(tokens, labels), ref(tokens, labels), rtol=1e-5, atol=1e-6)
    fresh = _tied(external=False)  # the initial weights: engine.load_state_dict writes the shards
    engine.load_state_dict({f"module.{k}": v for k, v in fresh.state_dict().items()})
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach(), rtol=0, atol=0, msg=n)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [2, 3])
def test_tied_twice_called_external_and_eval_match_torch(stage: int) -> None:
    run_world(_tied_run, 2, stage)


def _init_and_gather(rank: int, world: int) -> None:
    import dslaunch
    import dslaunch.zero
    from dslaunch.runtime.zero.partition_parameters import ZeroParamStatus

    full = make_model()  # Init sets up the process group itself, as DeepSpeed's
    with dslaunch.zero.Init():
        model = make_model()
    total = sum(p.numel() for p in full.parameters())
    held = sum(p.ds_tensor.numel() for p in model.parameters())
    # Lightning's DeepSpeed model summary counts a rank's parameters with partition_numel()
    assert sum(p.partition_numel() for p in model.parameters()) == held
    assert all(p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert held <= total / world + len(list(model.parameters())), (held, total)
    assert sum(run for run in [held]) * world >= total
    w = model.head.weight
    assert (w.ds_numel, w.ds_shape) == (full.head.weight.numel(), full.head.weight.shape)
    with dslaunch.zero.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), full.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.data, rtol=0, atol=0)
        w.data.fill_(float(rank))  # dropped: no modifier_rank
    with dslaunch.zero.GatheredParameters(w):
        torch.testing.assert_close(w.data, full.head.weight.data, rtol=0, atol=0)
    with dslaunch.zero.GatheredParameters(w, modifier_rank=world - 1):
        assert w.ds_status is ZeroParamStatus.AVAILABLE
        w.data.fill_(float(rank) + 7)
    assert w.numel() == 0
    assert torch.all(w.ds_tensor == world + 6)
    with dslaunch.zero.GatheredParameters([w], enabled=False):
        assert w.numel() == 0
    with dslaunch.zero.Init(enabled=False):
        plain = make_model()
    assert not hasattr(plain.head.weight, "ds_numel")
    dslaunch.zero.Init(module=plain)
    assert plain.head.weight.numel() == 0 and plain.head.weight.ds_numel == w.ds_numel


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_init_partitions_and_gathered_parameters(world: int) -> None:
    run_world(_init_and_gather, world)


def _init_then_train(rank: int, world: int) -> list[float]:
    cfg = config(3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return engine_losses(rank, world, cfg, zero_init=True)


@pytest.mark.timeout(60)
def test_model_built_under_init_trains_like_torch(reference: list[float]) -> None:
    for losses in run_world(_init_then_train, 2):
        assert len(losses) == STEPS
        assert_close(losses, reference, 1e-5)


def test_import_paths() -> None:
    import dslaunch
    import dslaunch.zero
    from dslaunch.runtime.zero import partition_parameters

    assert dslaunch.zero.Init is partition_parameters.Init
    assert dslaunch.runtime.zero.GatheredParameters is partition_parameters.GatheredParameters
    assert {"Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter"} <= set(dir(dslaunch.zero))
    for name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
                 "safe_set_full_fp32_param", "set_z3_leaf_modules"):
        assert callable(getattr(dslaunch.utils, name))


def _constructors_under_init(rank: int, world: int) -> None:
    import contextlib

    import dslaunch.zero
    from dslaunch.runtime.zero import partition_parameters as pp

    with dslaunch.zero.Init(dtype=torch.bfloat16):
        assert torch.zeros(2).dtype is torch.bfloat16 and torch.full((2,), 1.5).dtype is torch.bfloat16
        assert torch.arange(3).dtype is torch.int64  # not floating point: kept
        assert torch.arange(3.0).dtype is torch.bfloat16
        assert torch.tensor([1.0], requires_grad=True).is_leaf  # cast in place
        with dslaunch.zero.Init(dtype=torch.float16):  # nested: the outer one's constructors stay
            assert torch.ones(1).dtype is torch.bfloat16
        assert torch.ones(1).dtype is torch.bfloat16
    assert torch.zeros(1).dtype is torch.float32 and torch.arange is pp._orig_torch_arange

    @contextlib.contextmanager
    def keep_arange():  # transformers' prevent_arange_dtype_change, shortened
        original = pp.zero_wrapper_for_fp_tensor_constructor

        def wrapper(fn, *args, **kwargs):
            return fn if fn is pp._orig_torch_arange else original(fn, *args, **kwargs)
        pp.zero_wrapper_for_fp_tensor_constructor = wrapper
        try:
            yield
        finally:
            pp.zero_wrapper_for_fp_tensor_constructor = original
    with keep_arange(), dslaunch.zero.Init(config_dict_or_path={"bf16": {"enabled": True}}):
        assert torch.arange(3.0).dtype is torch.float32 and torch.empty(2).dtype is torch.bfloat16
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.ds_tensor.dtype is torch.bfloat16 and torch.empty(1).dtype is torch.float32


@pytest.mark.timeout(60)
def test_init_wraps_tensor_constructors_as_deepspeed() -> None:
    """Inside Init torch's constructors make floating tensors in its dtype (transformers replaces
    the wrapper to keep arange's), and are torch's again after it."""
    run_world(_constructors_under_init, 2)


class _HeadFunction(torch.autograd.Function):
    """TRL's chunked log-prob pattern: saves the head's weight for backward and gathers it there
    again by its ``ds_status`` (DeepSpeed hands backward the Parameter itself)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h, weight)
        return h @ weight.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import dslaunch.zero
        from dslaunch.runtime.zero.partition_parameters import ZeroParamStatus

        h, weight = ctx.saved_tensors
        _HeadFunction.saw.append(weight)
        gathered = hasattr(weight, "ds_numel") and weight.ds_status is not ZeroParamStatus.AVAILABLE
        with dslaunch.zero.GatheredParameters([weight], enabled=gathered):
            return grad @ weight, grad.t() @ h

    saw: list[torch.Tensor] = []


class _HeadByFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(D, D)
        self.head = torch.nn.Linear(D, V, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import dslaunch.zero

        h = torch.tanh(self.body(x))
        with dslaunch.zero.GatheredParameters([self.head.weight]):  # read outside its module, as TRL
            logits = _HeadFunction.apply(h, self.head.weight)
        return torch.nn.functional.cross_entropy(logits, labels)


def _function_run(rank: int, world: int) -> None:
    import dslaunch
    import dslaunch.zero

    torch.manual_seed(4)
    ref = _HeadByFunction()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(4)
    model = _HeadByFunction()
    cfg = {"train_batch_size": 4, "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "gradient_clipping": 0.0}  # the torch reference does not clip (DeepSpeed's default: 1.0)
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(6)
    micro = 4 // world
    for _ in range(3):
        x, labels = torch.randn(4, D, generator=g), torch.randint(0, V, (4,), generator=g)
        ref_loss = ref(x, labels)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        _HeadFunction.saw.clear()
        loss = engine(x[rank * micro:(rank + 1) * micro], labels[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        assert [w is model.head.weight for w in _HeadFunction.saw] == [True], _HeadFunction.saw
    full = dslaunch.zero.GatheredParameters(list(model.parameters()))
    with full:
        for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.data, q.detach(), rtol=1e-5, atol=1e-6, msg=n)
    assert torch.autograd.Function.__dict__["apply"].__func__.__name__ == "apply"  # torch's again


@pytest.mark.timeout(60)
def test_custom_function_saves_the_zero3_parameter_itself() -> None:
    """A custom autograd Function that saves a ZeRO-3 Parameter gets the Parameter back in backward
    (with its ``ds_*`` attributes) while stage 3's saved-tensor hooks run, and trains like torch."""
    run_world(_function_run, 2)


def _unwrapped(rank: int, world: int) -> tuple[bool, bool, bool, list[float], list[float]]:
    import dslaunch
    from dslaunch.runtime.zero import unwrap_model_for_generation
    from dslaunch.runtime.zero.partition_parameters import ZeroParamStatus

    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    cfg = {"train_batch_size": 2 * world, "steps_per_print": 1000, "gradient_clipping": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = dslaunch.initialize(model=make_model(), config=cfg)
    params = list(engine.module.parameters())
    losses, expected = [], []
    whole = same = True
    for i, (tokens, labels) in enumerate(batches(3, 2 * world)):
        loss = engine(tokens[2 * rank:2 * rank + 2], labels[2 * rank:2 * rank + 2])
        engine.backward(loss)
        engine.step()
        ref_losses = [ref(tokens[2 * r:2 * r + 2], labels[2 * r:2 * r + 2]) for r in range(world)]
        (sum(ref_losses) / world).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        expected.append(ref_losses[rank].item())
        if i == 0:  # between steps, as TRL generates between its training steps
            with unwrap_model_for_generation(engine) as unwrapped, torch.no_grad():
                whole = unwrapped is engine and all(
                    p.ds_status is ZeroParamStatus.AVAILABLE and p.shape == q.shape
                    for p, q in zip(params, ref.parameters(), strict=True))
                same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-7) for p, q in zip(params, ref.parameters(), strict=True))
    released = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params)
    return whole, same, released, losses, expected


@pytest.mark.timeout(60)
def test_unwrap_model_for_generation_holds_every_parameter_whole_and_training_goes_on() -> None:
    """Inside the block every parameter is whole (the trained values); after it they are
    partitioned again and the next steps train as plain torch."""
    for whole, same, released, losses, expected in run_world(_unwrapped, 2):
        assert whole and same and released
        assert losses == pytest.approx(expected, rel=1e-5)


def test_mics_is_refused_in_one_line() -> None:
    """``deepspeed.zero.MiCS_Init`` imports (a script may import it at its top) and refuses on use."""
    import dslaunch.zero
    from dslaunch.errors import NotInDslaunchError
    from dslaunch.runtime import zero

    assert dslaunch.zero.MiCS_Init is zero.MiCS_Init
    with pytest.raises(NotInDslaunchError, match=r"^dslaunch\.runtime\.zero\.mics\.MiCS_Init: MiCS .* is not in dslaunch; "
                       r"use deepspeed\.zero\.Init with ZeRO stage 3"):
        dslaunch.zero.MiCS_Init(config_dict_or_path={"zero_optimization": {"stage": 3, "mics_shard_size": 2}})


class _Block(torch.nn.Module):
    def __init__(self, width: int, device: object = None):
        super().__init__()
        self.inner = torch.nn.Linear(width, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _SkipInitModel(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.first = torch.nn.utils.skip_init(torch.nn.Linear, width, width)
        self.block = torch.nn.utils.skip_init(_Block, width)  # its child is built on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.first(x))


def _skip_init_run(rank: int, world: int) -> tuple[list[int], float]:
    import dslaunch

    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with dslaunch.zero.Init(config_dict_or_path=cfg):
        model = _SkipInitModel(10)
    pieces = [model.first.weight.ds_tensor.numel(), model.block.inner.weight.ds_tensor.numel()]
    with torch.no_grad():  # skip_init leaves the values undefined: give them some
        with dslaunch.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            for p in model.parameters():
                p.fill_(0.1)
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    loss = engine(torch.ones(2, 10)).square().mean()
    engine.backward(loss)
    engine.step()
    return pieces, loss.item()


@pytest.mark.timeout(90)
def test_skip_init_modules_built_under_init_are_partitioned_once_materialised() -> None:
    # torch.nn.utils.skip_init builds a module on meta then calls to_empty: its children must not
    # be partitioned while they have no values (DeepSpeed's test_zero.py::TestParamPartitioningSkipInit)
    for pieces, loss in run_world(_skip_init_run, 2, timeout=80):
        assert pieces == [50, 50]
        assert loss == pytest.approx(((0.1 * 10 + 0.1) * 0.1 * 10 + 0.1) ** 2, rel=1e-5)
