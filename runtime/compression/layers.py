"""The compressing layers ``init_compression`` puts in place of ``nn.Linear``, ``nn.Conv2d``,
``nn.Embedding`` and ``nn.BatchNorm2d`` (``deepspeed.compression.basic_layer``).

Each is its torch layer (a subclass: ``isinstance(m, nn.Linear)`` stays true, the state dict keys
stay) plus switches. ``enable_*`` prepares a technique (masks, learnable mask scores, quantizers);
the compression scheduler turns the ``*_enabled`` flags on at the configured steps; ``forward``
applies what is on (fake-quantized weight, pruning masks, fake-quantized input); ``fix_*``
(``redundancy_clean``) makes it permanent, and with ``dim_reduction`` really drops the pruned
rows, heads or channels (and the matching columns of the layer after), so the weights shrink.

A weight's quantization schedule lives on the weight itself (``start_bits``, ``target_bits``,
``q_period``), where the optimizer-step quantizer (``runtime/quantize.py``) reads and updates it;
a weight replaced by a smaller one keeps them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import init

from dslaunch.runtime.compression.quantizers import (
    AsymQuantizer,
    QuantAct,
    SymQuantizer,
    TopKBinarizer,
    weight_quantizer,
)
from dslaunch.utils.logging import logger

__all__ = ["LinearLayer_Compress", "Conv2dLayer_Compress", "Embedding_Compress", "BNLayer_Compress"]

_SCHEDULE = ("start_bits", "target_bits", "q_period")


def _scores(shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    """Learnable mask scores, drawn as DeepSpeed draws them (fp32, Kaiming uniform, a=sqrt(5)):
    the same seed gives the same masks."""
    scores = nn.Parameter(torch.empty(shape).to(device))
    init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


class _Compressible:
    """What the compressing layers share: weight quantization, sparse pruning, activation
    quantization, and replacing the weight by a pruned one."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def _init_compression(self) -> None:
        for name in _SCHEDULE:
            setattr(self.weight, name, None)
        self.sparse_pruning_method = self.activation_quantization_method = None
        self.weight_quantization_enabled_in_forward = self.weight_quantization_enabled = False
        self.sparse_pruning_enabled = self.activation_quantization_enabled = False

    def _replace_weight(self, data: torch.Tensor) -> None:
        schedule = {name: getattr(self.weight, name, None) for name in _SCHEDULE}
        self.weight = nn.Parameter(data)
        for name, value in schedule.items():
            setattr(self.weight, name, value)

    def _fix_output_pruning(self, kind: str, dim_reduction: bool) -> torch.Tensor:
        """Make ``kind`` pruning of the outputs (``row`` or ``channel``: dim 0 of the weight, and
        the bias) permanent: pruned outputs removed with ``dim_reduction``, zeroed otherwise; the
        mask and scores (DeepSpeed's ``<kind>_pruning_mask``, ``<kind>_mask_scores``) go. Returns
        the kept-outputs mask."""
        mask = self.get_mask(pruning_type=kind).bool()
        if dim_reduction:
            self._replace_weight(self.weight.data[mask.view(-1)])
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data[mask.view(-1)])
        else:
            self.weight.data = self.weight.data * mask.view(-1, *[1] * (self.weight.dim() - 1))
            if self.bias is not None:
                self.bias.data = self.bias.data * mask.view(-1)
        delattr(self, f"{kind}_pruning_mask")
        if getattr(self, f"{kind}_pruning_method") == "topk":
            delattr(self, f"{kind}_mask_scores")
        setattr(self, f"{kind}_pruning_method", None)
        return mask

    # ---- weight quantization ------------------------------------------------------------------
    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int) -> None:
        """Record the bits schedule on the weight; with ``weight_quantization_enabled_in_forward``
        each forward uses the weight fake-quantized to ``target_bits`` in ``num_groups`` groups."""
        self.weight.start_bits, self.weight.target_bits, self.weight.q_period = \
            start_bits, target_bits, quantization_period
        self.weight_quantization_enabled_in_forward = weight_quantization_enabled_in_forward
        if weight_quantization_enabled_in_forward:
            logger.warning("quantize_weight_in_forward: the weights are fake-quantized in each forward "
                           "(the bits schedule of the optimizer-step quantizer does not apply)")
            self.weight_quantizer = weight_quantizer(target_bits, quantization_type)
            self.weight_quantize_num_groups = num_groups

    def fix_weight_quantization(self) -> None:
        """Store the quantized weight itself and stop quantizing in forward."""
        self.weight.data = self.weight_quantizer(self.weight, self.weight.target_bits, None, None,
                                                 self.weight_quantize_num_groups).data
        self.weight_quantization_enabled_in_forward = False

    def _forward_weight(self) -> torch.Tensor:
        if self.weight_quantization_enabled_in_forward and self.weight_quantization_enabled:
            return self.weight_quantizer(self.weight, self.weight.target_bits, None, None,
                                         self.weight_quantize_num_groups)
        return self.weight

    # ---- sparse pruning -----------------------------------------------------------------------
    def enable_sparse_pruning(self, ratio: float, method: str) -> None:
        """Keep the ``ratio`` largest weights: by magnitude, fixed now (``l1``), or by learned
        scores (``topk``, a parameter ``sparse_mask_scores`` trained straight through)."""
        self.sparse_pruning_ratio, self.sparse_pruning_method = ratio, method
        mask = None
        if method == "l1":
            mask = TopKBinarizer.apply(self.weight.data.abs(), ratio, False).view(self.weight.size())
        elif method == "topk":
            self.sparse_mask_scores = _scores(tuple(self.weight.size()), self.weight.device)
        else:
            raise NotImplementedError(f"sparse pruning method {method!r}: l1 or topk")
        self.register_buffer("sparse_pruning_mask", mask)

    def fix_sparse_pruning_helper(self) -> None:
        """Zero the pruned weights for good and drop the mask."""
        self.weight.data = self.weight.data * self.get_mask(pruning_type="sparse")
        del self.sparse_pruning_mask
        if self.sparse_pruning_method == "topk":
            del self.sparse_mask_scores
        self.sparse_pruning_method = None
        self.sparse_pruning_enabled = False

    def _mask(self, kind: str) -> torch.Tensor:
        """The 0/1 mask of pruning ``kind``: stored (l1) or from the learned scores (topk)."""
        method = getattr(self, f"{kind}_pruning_method")
        if method == "l1" and kind != "head":
            return getattr(self, f"{kind}_pruning_mask").to(self.weight.device)
        if method == "topk":
            scores = self.head_pruning_scores if kind == "head" else getattr(self, f"{kind}_mask_scores")
            return TopKBinarizer.apply(scores, getattr(self, f"{kind}_pruning_ratio"), False)
        raise NotImplementedError(f"{kind} pruning is not enabled on this layer")

    # ---- activation quantization ----------------------------------------------------------------
    def enable_activation_quantization(self, bits: int, quantization_type: str, range_calibration: str) -> None:
        """Fake-quantize this layer's input to ``bits``: per token (per sample for conv) ranges
        (``dynamic``) or one running range (``static``, a ``QuantAct``)."""
        if bits not in (4, 8):
            raise ValueError(f"activation quantization to {bits} bits: 4 or 8 only")
        self.activation_quantization_bits = bits
        self.activation_quantization_method = f"{quantization_type}_{range_calibration}"
        if range_calibration == "static":
            self.activation_quantizer = QuantAct(quant_mode=quantization_type)
        else:
            self.activation_quantizer = SymQuantizer.apply if quantization_type == "symmetric" else AsymQuantizer.apply

    def _quantize_input(self, x: torch.Tensor, dynamic_groups: int) -> torch.Tensor:
        if not self.activation_quantization_enabled:
            return x
        groups = dynamic_groups if "dynamic" in self.activation_quantization_method else 1
        return self.activation_quantizer(x, self.activation_quantization_bits, None, None, groups)


class LinearLayer_Compress(_Compressible, nn.Linear):  # noqa: N801 (DeepSpeed's name)
    """``nn.Linear`` with weight/activation quantization and sparse, row and head pruning."""

    def __init__(self, *args: Any, bias: bool = True):
        super().__init__(*args, bias=bias)
        self._init_compression()
        self.row_pruning_method = self.head_pruning_method = None
        self.row_pruning_enabled = self.head_pruning_enabled = False

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparse pruning={self.sparse_pruning_method is not None}, row pruning="
                f"{self.row_pruning_method is not None}, head pruning={self.head_pruning_method is not None}, "
                f"activation quantization={self.activation_quantization_method is not None}, "
                f"weight_quantization={self.weight.target_bits}")

    def enable_row_pruning(self, ratio: float, method: str) -> None:
        """Keep the ``ratio`` output rows of largest L1 norm (``l1``) or learned scores (``topk``)."""
        self.row_pruning_ratio, self.row_pruning_method = ratio, method
        mask = None
        if method == "l1":
            norms = torch.linalg.norm(self.weight.data, ord=1, dim=1)
            mask = TopKBinarizer.apply(norms, ratio, False).view(-1, 1).to(self.weight.device)
        elif method == "topk":
            self.row_mask_scores = _scores((self.weight.size(0), 1), self.weight.device)
        else:
            raise NotImplementedError(f"row pruning method {method!r}: l1 or topk")
        self.register_buffer("row_pruning_mask", mask)

    def enable_head_pruning(self, ratio: float, method: str, num_heads: int) -> None:
        """Keep the ``ratio`` attention heads of largest learned score; this layer is the output
        projection, whose input columns are the heads."""
        if method != "topk":
            raise NotImplementedError(f"head pruning method {method!r}: topk only")
        self.num_heads, self.head_pruning_ratio, self.head_pruning_method = num_heads, ratio, method
        self.head_pruning_scores = _scores((1, num_heads), self.weight.device)

    def get_mask(self, pruning_type: str = "row") -> torch.Tensor:
        """The current 0/1 mask of ``sparse``, ``row`` or ``head`` pruning."""
        if pruning_type not in ("sparse", "row", "head"):
            raise NotImplementedError(f"pruning type {pruning_type!r}")
        return self._mask(pruning_type)

    def head_pruning_reshape(self, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape
        return (w.t().reshape(self.num_heads, -1) * mask.view(-1, 1)).reshape(cols, rows).t()

    def fix_row_col_pruning_helper(self, mask: torch.Tensor | None = None, dim_reduction: bool = False
                                   ) -> torch.Tensor | None:
        """Without ``mask``: this layer's row pruning made permanent (rows removed with
        ``dim_reduction``, zeroed otherwise); returns the kept-rows mask. With the previous layer's
        ``mask``: remove the matching input columns; returns None."""
        if mask is None:
            mask = self._fix_output_pruning("row", dim_reduction)
            self.out_features = self.weight.size(0)
        else:
            self._replace_weight(self.weight.data[:, mask.view(-1)])
            self.in_features = self.weight.size(1)
            mask = None
        self.row_pruning_enabled = False
        return mask

    def fix_head_pruning_helper(self, mask: torch.Tensor | None = None, num_heads: int | None = None,
                                dim_reduction: bool = False) -> torch.Tensor | None:
        """Without ``mask``: this output projection's head pruning made permanent (the pruned
        heads' input columns removed with ``dim_reduction``, zeroed otherwise); returns the kept-heads
        mask. With it: remove the pruned heads' output rows (a query, key or value projection)."""
        num_heads = num_heads or self.num_heads
        if mask is None:
            if self.head_pruning_method != "topk":
                raise NotImplementedError("head pruning is not enabled on this layer")
            mask = self.get_mask(pruning_type="head").bool()
            if dim_reduction:
                rows = self.weight.size(0)
                kept = self.weight.data.t().reshape(num_heads, -1)[mask.view(-1), :]
                self._replace_weight(kept.reshape(-1, rows).t())
                self.in_features = self.weight.size(1)
            else:
                rows, cols = self.weight.size()
                self.weight.data = (self.weight.data.t().reshape(self.num_heads, -1) * mask.view(-1, 1)
                                    ).reshape(cols, rows).t()
            del self.head_pruning_scores
            self.head_pruning_method = None
        else:
            cols = self.weight.size(1)
            self._replace_weight(self.weight.data.reshape(num_heads, -1)[mask.view(-1), :].reshape(-1, cols))
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.data.reshape(num_heads, -1)[mask.view(-1), :].reshape(-1))
            self.out_features = self.weight.size(0)
        self.head_pruning_enabled = False
        return mask

    def forward(self, input: torch.Tensor, skip_bias_add: bool = False) -> Any:  # noqa: A002 (torch's name)
        weight, bias = self._forward_weight(), self.bias
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self.get_mask(pruning_type="sparse").view(self.weight.size())
        if self.row_pruning_enabled and self.row_pruning_method:
            mask = self.get_mask(pruning_type="row")
            weight = weight * mask.view(-1, 1)
            bias = bias * mask.view(-1) if bias is not None else None
        if self.head_pruning_enabled and self.head_pruning_method:
            weight = self.head_pruning_reshape(weight, self.get_mask(pruning_type="head"))
        x = self._quantize_input(input, input.numel() // input.size(-1))  # dynamic: one range per token
        if skip_bias_add:  # the model-parallel layers add the bias after their reduction
            return nn.functional.linear(x, weight, None), bias
        return nn.functional.linear(x, weight, bias)


class Conv2dLayer_Compress(_Compressible, nn.Conv2d):  # noqa: N801 (DeepSpeed's name)
    """``nn.Conv2d`` with weight/activation quantization and sparse and channel pruning."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._init_compression()
        self.channel_pruning_method = None
        self.channel_pruning_enabled = False

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, sparse pruning={self.sparse_pruning_method is not None}, channel pruning="
                f"{self.channel_pruning_method is not None}, activation quantization="
                f"{self.activation_quantization_method is not None}, weight_quantization={self.weight.target_bits}")

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int) -> None:
        """As the linear layer's; in forward 4 bits or more only (as DeepSpeed)."""
        if weight_quantization_enabled_in_forward and target_bits < 4:
            raise ValueError(f"convolution weights quantized in forward to {target_bits} bits: 4 or more only")
        super().enable_weight_quantization(start_bits, target_bits, quantization_period,
                                           weight_quantization_enabled_in_forward, quantization_type, num_groups)

    def enable_channel_pruning(self, ratio: float, method: str) -> None:
        """Keep the ``ratio`` output channels of largest kernel L1 norm (``l1``) or learned score (``topk``)."""
        self.channel_pruning_ratio, self.channel_pruning_method = ratio, method
        mask = None
        if method == "l1":
            # DeepSpeed calls torch.linalg.norm over three dims, which torch refuses: the same L1 norm
            norms = self.weight.data.abs().sum(dim=(1, 2, 3))
            mask = TopKBinarizer.apply(norms, ratio, False).view(-1, 1, 1, 1).to(self.weight.device)
        elif method == "topk":
            self.channel_mask_scores = _scores((self.weight.size(0), 1, 1, 1), self.weight.device)
        else:
            raise NotImplementedError(f"channel pruning method {method!r}: l1 or topk")
        self.register_buffer("channel_pruning_mask", mask)

    def get_mask(self, pruning_type: str = "sparse") -> torch.Tensor:
        """The current 0/1 mask of ``sparse`` or ``channel`` pruning."""
        if pruning_type not in ("sparse", "channel"):
            raise NotImplementedError(f"pruning type {pruning_type!r}")
        return self._mask(pruning_type)

    def fix_channel_pruning_helper(self, mask: torch.Tensor | None = None, dim_reduction: bool = False
                                   ) -> torch.Tensor | None:
        """Without ``mask``: channel pruning made permanent (channels removed with ``dim_reduction``,
        zeroed otherwise); returns the kept-channels mask. With the previous layer's ``mask``:
        remove the matching input channels; returns None."""
        if mask is None:
            mask = self._fix_output_pruning("channel", dim_reduction)
            self.out_channels = self.weight.size(0)
        else:
            self._replace_weight(self.weight.data[:, mask.view(-1), ...])
            self.in_channels = self.weight.size(1) * self.groups
            mask = None
        self.channel_pruning_enabled = False
        return mask

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        weight, bias = self._forward_weight(), self.bias
        if self.sparse_pruning_enabled and self.sparse_pruning_method:
            weight = weight * self.get_mask(pruning_type="sparse").view(self.weight.size())
        if self.channel_pruning_enabled:
            mask = self.get_mask(pruning_type="channel")
            weight = weight * mask.view(-1, 1, 1, 1)
            bias = bias * mask.view(-1) if bias is not None else None
        x = self._quantize_input(input, input.numel() // input[0].numel())  # dynamic: one range per sample
        return nn.functional.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class Embedding_Compress(_Compressible, nn.Embedding):  # noqa: N801 (DeepSpeed's name)
    """``nn.Embedding`` with weight quantization, one range per token (row)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self._init_compression()

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"weight_quantization={self.weight.target_bits}")

    def enable_weight_quantization(self, start_bits: int, target_bits: int, quantization_period: int,
                                   weight_quantization_enabled_in_forward: bool, quantization_type: str,
                                   num_groups: int) -> None:
        """As the linear layer's, but always one group per token (``num_groups`` is not used)."""
        super().enable_weight_quantization(start_bits, target_bits, quantization_period,
                                           weight_quantization_enabled_in_forward, quantization_type, self.weight.size(0))

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch's name)
        return nn.functional.embedding(input, self._forward_weight(), self.padding_idx, self.max_norm, self.norm_type,
                                       self.scale_grad_by_freq, self.sparse)


class BNLayer_Compress(nn.BatchNorm2d):  # noqa: N801 (DeepSpeed's name)
    """``nn.BatchNorm2d`` that follows the channel pruning of the convolution before it."""

    def fix_channel_pruning_helper(self, mask: torch.Tensor, dim_reduction: bool = True) -> None:
        """Keep the channels ``mask`` keeps: affine weights and running statistics."""
        keep = mask.view(-1)
        self.weight = nn.Parameter(self.weight.data[keep])
        self.bias = nn.Parameter(self.bias.data[keep])
        self.running_mean = self.running_mean[keep]
        self.running_var = self.running_var[keep]
        self.num_features = int(keep.sum())
