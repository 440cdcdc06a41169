"""``replace_with_kernel_inject``: the fused kernels of ``kernels/`` in place of the modules whose
outputs they reproduce.

A candidate is replaced only after a probe: the module and its fused replacement run on the same
random input, on the module's device and dtype, and must agree to the dtype's rounding. So an
``RMSNorm`` with another formula (Gemma's ``1 + weight``), a norm over other axes, or an
activation that is not GeLU is left as it is, never silently changed.

- normalizations: ``nn.LayerNorm`` and ``*LayerNorm`` / ``*RMSNorm`` classes with a ``weight`` and
  an ``eps`` / ``variance_epsilon`` -> ``FusedLayerNorm`` / ``FusedRMSNorm`` (Triton on CUDA);
- a ``Linear`` (with a bias) whose output goes straight into a GeLU module: the bias moves into a
  ``BiasGeLU`` that replaces the activation (bias + GeLU in one kernel on CUDA); found by running
  the model once on a tiny ``input_ids`` batch.

The engine calls ``inject_kernels`` on CUDA only (on CPU the kernels are torch's own ops: a no-op,
said in one line); the module itself runs anywhere, the tests check it on CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dslaunch.kernels.bias_gelu import BiasGeLU
from dslaunch.kernels.normalization import FusedLayerNorm, FusedRMSNorm
from dslaunch.runtime.tensor_parallel.auto_tp import example_input, is_linear
from dslaunch.runtime.tensor_parallel.layers import ColumnParallelLinear

__all__ = ["inject_kernels"]


def _agrees(old: Callable[[torch.Tensor], torch.Tensor], new: Callable[[torch.Tensor], torch.Tensor],
            probe: torch.Tensor) -> bool:
    with torch.no_grad():
        a, b = old(probe), new(probe)
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    tol = 1e-5 if probe.dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _fused_norm(module: nn.Module) -> nn.Module | None:
    """The fused twin of a norm module (same weights), or None if it is no norm we know."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    if eps is None and isinstance(module, nn.RMSNorm):
        eps = torch.finfo(module.weight.dtype).eps  # torch's default for eps=None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    name = type(module).__name__
    if isinstance(module, nn.LayerNorm) or name.endswith("LayerNorm"):
        bias = getattr(module, "bias", None)
        fused: nn.Module = FusedLayerNorm(weight.shape[0], eps=eps, elementwise_affine=True, bias=bias is not None,
                                          device=weight.device, dtype=weight.dtype)
    elif isinstance(module, nn.RMSNorm) or name.endswith("RMSNorm"):
        fused = FusedRMSNorm(weight.shape[0], eps=eps, device=weight.device, dtype=weight.dtype)
    else:
        return None
    fused.load_state_dict({k: v for k, v in module.state_dict().items() if k in ("weight", "bias")})
    return fused


def _gelu_kind(act: nn.Module, probe: torch.Tensor) -> str | None:
    """``"none"`` or ``"tanh"``: which GeLU ``act`` computes (by its outputs), else None."""
    for approximate in ("none", "tanh"):
        if _agrees(act, lambda x, a=approximate: torch.nn.functional.gelu(x, approximate=a), probe):
            return approximate
    return None


def _linear_then_act(model: nn.Module) -> list[tuple[str, str]]:
    """(Linear name, module name) where the module's input was exactly the Linear's output."""
    produced: dict[int, str] = {}
    pairs: list[tuple[str, str]] = []
    handles = []
    for name, module in model.named_modules():
        if _takes_bias_out(module):
            handles.append(module.register_forward_hook(
                lambda m, a, out, name=name: produced.__setitem__(id(out), name)))
        elif not list(module.children()):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, name=name: pairs.append((produced[id(args[0])], name))
                if args and id(args[0]) in produced else None))
    device = next(p.device for p in model.parameters())
    try:
        with torch.no_grad():
            model(**example_input(model, device))
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(pairs))


def _takes_bias_out(module: nn.Module) -> bool:
    """Linears that compute ``F.linear(x, w, b)`` and so run without their bias (not GPT-2's Conv1D,
    which needs one; at tp > 1 it is a ColumnParallelLinear and qualifies)."""
    return isinstance(module, (nn.Linear, ColumnParallelLinear))


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def inject_kernels(model: nn.Module) -> list[str]:
    """Replace what the fused kernels reproduce (see the module docstring); returns the names."""
    replaced = []
    for name, module in list(model.named_modules()):
        fused = _fused_norm(module)
        if fused is not None:
            probe = torch.randn(3, fused.weight.shape[0], device=fused.weight.device, dtype=fused.weight.dtype)
            if _agrees(module, fused, probe):
                _set(model, name, fused)
                replaced.append(name)
    try:
        pairs = _linear_then_act(model)
    except Exception:  # noqa: BLE001 (a model that needs other inputs: norms only)
        pairs = []
    for linear_name, act_name in pairs:
        linear, act = model.get_submodule(linear_name), model.get_submodule(act_name)
        bias = getattr(linear, "bias", None)
        if bias is None or is_linear(act) or sum(1 for _ in act.parameters()) or act_name == linear_name:
            continue
        kind = _gelu_kind(act, torch.randn(64, device=bias.device, dtype=bias.dtype) * 3)
        if kind is None:
            continue
        fused = BiasGeLU(bias.shape[0], approximate=kind, device=bias.device, dtype=bias.dtype)
        fused.bias.data.copy_(bias.detach())
        linear.bias = None  # added by the fused kernel instead
        _set(model, act_name, fused)
        replaced.append(act_name)
    return replaced
