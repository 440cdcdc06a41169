"""``deepspeed.runtime.domino.async_linear``: Domino's two tensor-parallel linears.

- ``DominoAsyncColumnParallelLinear``: the output split over the tensor-parallel ranks. Its
  backward starts the all-reduce of the input gradient and returns at once; the handle goes into
  the ``handle_dic`` the forward was given, under the micro batch's key, and ``wait_backward_comm``
  (Domino's ``NoOper``) waits on it where the gradient is next used. The other micro batch's
  backward runs meanwhile: that is Domino's overlap.
- ``RowParallelLinearNoComm``: the input split; it returns this rank's partial sum (and the bias,
  with ``skip_bias_add``), and the caller all-reduces it, asynchronously, when it chooses.

Differences from DeepSpeed 0.19.8: each linear all-reduces over the group it was built with
(DeepSpeed keeps the first one built in a module global, so a second model on another group
reduces over the wrong ranks).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError

__all__ = ["DominoAsyncColumnParallelLinearImpl", "DominoAsyncColumnParallelLinear", "RowParallelLinearNoComm",
           "config_value"]


def config_value(config: Any, name: str) -> Any:
    """``config.name`` (a Megatron ``TransformerConfig``-like object), or one line naming it.

    Raises:
        UsageError: ``config`` has no ``name``.
    """
    if not hasattr(config, name):
        raise UsageError(f"Domino: the model config ({type(config).__name__}) has no {name!r}; Domino reads "
                         "Megatron's TransformerConfig fields (hidden_size, num_attention_heads, kv_channels, "
                         "ffn_hidden_size, params_dtype, init_method, ...)")
    return getattr(config, name)


def _device() -> str:
    from dslaunch.runtime.accelerator import get_accelerator

    return get_accelerator().current_device_name()


def _parameters(module: torch.nn.Module, output_size: int, input_size: int, config: Any,
                init_method: Callable[[torch.Tensor], Any], bias: bool) -> None:
    """``weight`` (``output_size`` x ``input_size``) and ``bias`` on the accelerator, initialised as
    Megatron does: ``init_method`` on the weight, zeros for the bias, both only with
    ``config.perform_initialization``."""
    dtype, initialise = config_value(config, "params_dtype"), config_value(config, "perform_initialization")
    module.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=_device(), dtype=dtype))
    if initialise:
        init_method(module.weight)
    if bias:
        module.bias = torch.nn.Parameter(torch.empty(output_size, device=_device(), dtype=dtype))
        if initialise:
            with torch.no_grad():
                module.bias.zero_()
    else:
        module.register_parameter("bias", None)


class DominoAsyncColumnParallelLinearImpl(torch.autograd.Function):
    """``input @ weight.T + bias``; backward all-reduces the input gradient without waiting."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                handle_dic: MutableMapping[str, Any], h_id: str, group: Any = None) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        ctx.has_bias, ctx.handle_dic, ctx.h_id, ctx.group = bias is not None, handle_dic, h_id, group
        return F.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        import torch.distributed as dist

        inp, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        # Waited on by wait_backward_comm where this gradient is next used, not here.
        ctx.handle_dic[ctx.h_id] = dist.all_reduce(grad_input, group=ctx.group, async_op=True)
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_weight = rows.t().matmul(inp.reshape(-1, inp.shape[-1]))
        grad_bias = rows.sum(dim=0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None


class DominoAsyncColumnParallelLinear(torch.nn.Module):
    """Column-parallel linear (this rank's ``output_size`` rows) whose backward overlaps its input
    gradient's all-reduce with the rest of the backward.

    Args:
        input_size, output_size: this rank's weight is ``output_size`` x ``input_size``.
        _tp_group: the tensor-parallel group the input gradient is all-reduced over.
        config: Megatron's TransformerConfig (``params_dtype``, ``perform_initialization``).
        init_method: initialises the weight.
        bias: with a bias (zeros).
        skip_bias_add: return the bias instead of adding it.
    """

    def __init__(self, input_size: int, output_size: int, _tp_group: Any, config: Any,
                 init_method: Callable[[torch.Tensor], Any], bias: bool = True, skip_bias_add: bool = False):
        super().__init__()
        self.skip_bias_add, self.tp_group = skip_bias_add, _tp_group
        _parameters(self, output_size, input_size, config, init_method, bias)

    def forward(self, input_: torch.Tensor, handle_dic: MutableMapping[str, Any],
                h_id: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias or None)``; the backward's all-reduce handle lands in ``handle_dic[h_id]``."""
        bias = None if self.skip_bias_add else self.bias
        out = DominoAsyncColumnParallelLinearImpl.apply(input_, self.weight, bias, handle_dic, h_id, self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinearNoComm(torch.nn.Module):
    """Row-parallel linear without its all-reduce: returns this rank's partial output.

    Args:
        input_size, output_size: this rank's weight is ``output_size`` x ``input_size``.
        config: Megatron's TransformerConfig (``params_dtype``, ``perform_initialization``).
        init_method: initialises the weight.
        bias: with a bias (zeros); added by the caller after the all-reduce with ``skip_bias_add``.
        stride: accepted as Megatron's (unused: the weight is one block).
    """

    def __init__(self, input_size: int, output_size: int, config: Any, init_method: Callable[[torch.Tensor], Any],
                 bias: bool = True, stride: int = 1, skip_bias_add: bool = False):
        super().__init__()
        self.skip_bias_add = skip_bias_add
        _parameters(self, output_size, input_size, config, init_method, bias)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(partial output, bias or None)``."""
        out = F.linear(input_, self.weight, None if self.skip_bias_add else self.bias)
        return out, (self.bias if self.skip_bias_add else None)
