"""A stand-in for torchvision, for running DeepSpeedExamples' vision scripts unchanged on a machine
where torchvision cannot be installed (its only build for torch 2.13 is a CUDA one) and nothing
can be downloaded. Only what those scripts use, written here:

- ``datasets.CIFAR10``: a small synthetic set of 32x32 RGB images in 10 classes (learnable: a
  class is a colour pattern plus noise), same item shape as the real one, nothing downloaded;
- ``transforms``: ``Compose``, ``ToTensor``, ``Normalize``, ``Resize``, ``CenterCrop``;
- ``models.AlexNet`` / ``vgg19``: AlexNet's layer structure (``features``, ``avgpool``,
  ``classifier``) with fewer channels, so a CPU test takes seconds.

Put this folder first on PYTHONPATH (tests/compat does). Never installed, never shipped.
"""

from torchvision import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
__version__ = "0.0+stand-in"
