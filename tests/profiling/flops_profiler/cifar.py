"""DeepSpeed's CIFAR example's ``Net`` (DeepSpeedExamples training/cifar/cifar10_deepspeed.py, no
MoE) as a Sequential, and its exact counts: two convolutions, max pooling, three Linears."""

from __future__ import annotations

from torch import nn


def cifar_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2, 2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, 10))


def cifar_flops(batch: int) -> tuple[int, int, int]:
    """(forward, backward, backward of the convolutions) flops of one 32x32 batch: a convolution's
    MACs are batch x out x in x kernel x output pixels; the image needs no gradient, so the first
    convolution's backward is its weight's gradient only, every other layer's is two forwards."""
    conv1, conv2 = batch * 6 * 3 * 25 * 28 * 28, batch * 16 * 6 * 25 * 10 * 10
    linears = batch * (400 * 120 + 120 * 84 + 84 * 10)
    convs_bwd = 2 * conv1 + 4 * conv2
    return 2 * (conv1 + conv2 + linears), convs_bwd + 4 * linears, convs_bwd
