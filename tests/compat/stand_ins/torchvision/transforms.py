"""The transforms DeepSpeedExamples' CIFAR and pipeline scripts compose (on tensors or HWC uint8)."""

import numpy
import torch
import torch.nn.functional as F


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """HWC uint8 (what the data set yields) to CHW float in [0, 1]."""

    def __call__(self, x):
        if isinstance(x, numpy.ndarray):
            x = torch.from_numpy(x)
        return x.permute(2, 0, 1).float() / 255.0


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


def _on_chw(fn, x):
    """Apply ``fn`` to a CHW tensor; an HWC uint8 array (an image before ToTensor) goes and comes back."""
    if not isinstance(x, numpy.ndarray):
        return fn(x)
    out = fn(torch.from_numpy(x).permute(2, 0, 1).float())
    return out.round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


class Resize:
    """Scale the shorter side to ``size`` (bilinear)."""

    def __init__(self, size):
        self.size = size

    def _resize(self, x):
        h, w = x.shape[-2:]
        scale = self.size / min(h, w)
        out = (round(h * scale), round(w * scale))
        return F.interpolate(x.unsqueeze(0), size=out, mode="bilinear", align_corners=False).squeeze(0)

    def __call__(self, x):
        return _on_chw(self._resize, x)


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def _crop(self, x):
        h, w = x.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., top:top + self.size, left:left + self.size]

    def __call__(self, x):
        return _on_chw(self._crop, x)
