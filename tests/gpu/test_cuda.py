"""dslaunch on a CUDA device: the Triton kernels compiled for it against torch in fp64 (forward and
backward, fp32/bf16/fp16; the chunked cross-entropy too), FusedAdam against torch's AdamW, the dispatch point, the accelerator
API and the monitor's NVML memory. Marked ``gpu``: skipped without a CUDA device (CI never has one);
``scripts/gpu/check.sh`` runs them on a lent GPU. The engine on NCCL is compared with the CPU run
there too (``scripts/gpu/engine_check.py``), not here: it needs the launcher around it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.marks import COMPILED_TRITON, NEEDS_CUDA
from tests.kernels.triton.interpret import max_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    NEEDS_CUDA,
    COMPILED_TRITON,
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Max error relative to max(1, max |reference|), against fp64: fp32 a few ulps of the accumulation
# order; bf16/fp16 four ulps of the output's rounding (the kernels compute in fp32).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}
CUDA = torch.device("cuda")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2 + 0.5).to(CUDA, dtype)


def _grads(fn, inputs: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    inputs = [t.detach().requires_grad_() for t in inputs]
    y = fn(*inputs)
    return [y, *torch.autograd.grad(y, inputs, dy)]


def _against_fp64(ours, theirs, inputs: list[torch.Tensor], dtype: torch.dtype) -> None:
    got = _grads(ours, inputs, dy := _randn(*inputs[0].shape, dtype=dtype, seed=9))
    want = _grads(theirs, [t.double() for t in inputs], dy.double())
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == dtype and a.device.type == "cuda"
        assert max_error(a, b) <= TOLERANCE[dtype], f"output {i}: {max_error(a, b)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (64, 1024), (3, 2, 4099), (16, 16384)])
def test_layer_norm_and_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from dslaunch.kernels.triton.norms import layer_norm, rms_norm

    n = shape[-1]
    x, w, b = _randn(*shape, dtype=dtype), _randn(n, dtype=dtype, seed=1), _randn(n, dtype=dtype, seed=2)
    _against_fp64(lambda x, w, b: layer_norm(x, w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5),
                  [x, w, b], dtype)
    _against_fp64(lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (n,), w, 1e-6), [x, w], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu(approximate: str, dtype: torch.dtype) -> None:
    from dslaunch.ops.bias_gelu import bias_gelu

    x, b = _randn(8, 33, 1027, dtype=dtype), _randn(1027, dtype=dtype, seed=1)
    _against_fp64(lambda x, b: bias_gelu(x, b, approximate), lambda x, b: F.gelu(x + b, approximate=approximate),
                  [x, b], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, vocab", [(1, 1), (7, 1000), (64, 32768), (5, 151936)])
def test_chunked_cross_entropy(rows: int, vocab: int, dtype: torch.dtype) -> None:
    from dslaunch.runtime.chunked_cross_entropy import chunked_cross_entropy

    logits = _randn(rows, vocab, dtype=dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3)).to(CUDA)
    target[0] = -100
    loss = chunked_cross_entropy(logits, target, reduction="none", backend="triton")
    (dx,) = torch.autograd.grad(loss.sum(), [logits])
    x64 = logits.detach().double().requires_grad_()
    want = F.cross_entropy(x64, target, reduction="none")
    (dx64,) = torch.autograd.grad(want.sum(), [x64])
    assert max_error(loss, want) <= TOLERANCE[torch.float32] and dx.dtype == dtype
    assert max_error(dx, dx64) <= TOLERANCE[dtype], max_error(dx, dx64)


def test_bias_gelu_dropout_keeps_one_mask_through_backward() -> None:
    from dslaunch.ops.bias_gelu import bias_gelu

    x, b = _randn(64, 4096).requires_grad_(), _randn(4096, seed=1)
    y = bias_gelu(x, b, p=0.25, seed=7)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.01
    full = F.gelu(x.detach() + b)
    assert max_error(y[kept], full[kept] / 0.75) <= 1e-5
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert bool((dx[~kept & (full != 0)] == 0).all()) and bool((dx[kept] != 0).any())
    assert torch.equal(bias_gelu(x.detach(), b, p=0.25, seed=7), y.detach())


@pytest.mark.parametrize("param_dtype", DTYPES)
def test_triton_adam_against_the_reference(param_dtype: torch.dtype) -> None:
    from dslaunch.kernels.reference import adam_update
    from dslaunch.kernels.triton.adam import adam_op

    sizes = [1, 7, 4096, 65539, 3 * 2**20 + 5]
    hyper = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1, "bias_correction": True,
             "adam_w_mode": True, "inv_scale": 0.5}

    def state(seed: int) -> list[list[torch.Tensor]]:
        return [[_randn(n, seed=seed + i, dtype=param_dtype) for i, n in enumerate(sizes)],
                [_randn(n, seed=seed + 50 + i, dtype=param_dtype) for i, n in enumerate(sizes)],
                [_randn(n, seed=seed + 100 + i) * 0.1 for i, n in enumerate(sizes)],
                [_randn(n, seed=seed + 150 + i).abs() for i, n in enumerate(sizes)]]

    ours, want = state(0), state(0)
    want64 = [[t.double() for t in x] for x in want]
    for step in (1, 2, 3):
        adam_op(*ours, step=step, **hyper)
        adam_update(*want64, step=step, **hyper)
    for name, a, b in zip(["param", "grad", "exp_avg", "exp_avg_sq"], ours, want64, strict=True):
        for t, r in zip(a, b, strict=True):
            tol = TOLERANCE[t.dtype] if name == "param" else 2e-5
            assert max_error(t, r) <= tol, (name, t.numel(), max_error(t, r))


def test_fused_adam_matches_torch_adamw() -> None:
    from dslaunch.ops.adam import FusedAdam

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    ours = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    theirs = torch.optim.AdamW(twin, lr=1e-3, weight_decay=0.01, foreach=False)
    for step in range(5):
        g = torch.Generator(device=CUDA).manual_seed(step)
        for p, q in zip(model.parameters(), twin, strict=True):
            p.grad = torch.randn(p.shape, device=CUDA, generator=g)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(model.parameters(), twin, strict=True):
        assert max_error(p, q) <= 1e-6


def test_fused_norms_take_rows_of_fused_min_features_and_more() -> None:
    """Narrower rows get torch's kernel (the Triton call's Python cost outweighs its device time in
    a step), wider ones the Triton kernel: the same values, told apart by their autograd node."""
    from dslaunch.ops.normalization import FUSED_MIN_FEATURES, FusedLayerNorm, FusedRMSNorm

    for n, fused in ((FUSED_MIN_FEATURES // 2, False), (FUSED_MIN_FEATURES, True)):
        x = _randn(4, n, dtype=torch.bfloat16).requires_grad_()
        for norm in (FusedLayerNorm(n), FusedRMSNorm(n)):
            y = norm.to(CUDA, torch.bfloat16)(x)
            assert ("_NormFunction" in type(y.grad_fn).__name__) is fused, (n, type(y.grad_fn).__name__)


def test_dispatch_picks_triton_on_cuda_and_the_reference_on_cpu() -> None:
    from dslaunch import kernels
    from dslaunch.kernels.triton import adam, norms

    assert kernels.get("adam", CUDA) is adam.adam_op
    assert kernels.get("layer_norm", "cuda:0") is norms.layer_norm
    assert kernels.get("layer_norm", "cpu") is not norms.layer_norm


def test_accelerator_on_cuda() -> None:
    from dslaunch.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc.device_name() == "cuda" and acc.device_name(0) == "cuda:0"
    assert acc.communication_backend_name() == "nccl" and acc.is_available()
    assert acc.device_count() == torch.cuda.device_count() >= 1
    assert acc.is_bf16_supported() and acc.is_fp16_supported() and acc.is_triton_supported()
    assert not acc.is_synchronized_device()
    before = acc.memory_allocated()
    x = torch.empty(64 << 20, dtype=torch.uint8, device=acc.current_device_name())
    assert acc.memory_allocated() - before >= 64 << 20 and acc.max_memory_allocated() >= 64 << 20
    stream, event = acc.Stream(), acc.Event()
    with acc.stream(stream):
        x.fill_(1)
        event.record()
    event.synchronize()
    assert int(x[-1]) == 1 and acc.total_memory() > 0


def test_monitor_memory_comes_from_nvml() -> None:
    from dslaunch.runtime.heartbeat import _MemorySampler

    torch.empty(1, device=CUDA)  # the sampler reads NVML once this process uses CUDA
    memory = _MemorySampler().sample()
    assert memory is not None and memory.kind == "gpu", memory
    # NVML counts the whole card; CUDA leaves out what the driver keeps (0.4% on an H200)
    assert 1.0 <= memory.total / torch.cuda.get_device_properties(0).total_memory < 1.02
    assert 0 < memory.used <= memory.total and memory.peak >= memory.used


def test_more_local_ranks_than_gpus_is_one_clear_error() -> None:
    from dslaunch.errors import UsageError
    from dslaunch.runtime.dist import device_for

    count = torch.cuda.device_count()
    assert device_for(count - 1) == torch.device("cuda", count - 1)
    with pytest.raises(UsageError, match=f"LOCAL_RANK={count} but this process sees {count} GPU"):
        device_for(count)
