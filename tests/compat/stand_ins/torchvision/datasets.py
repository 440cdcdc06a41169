"""``CIFAR10`` without a download: synthetic 32x32x3 uint8 images whose class is learnable."""

import numpy


class CIFAR10:
    """``STANDIN_CIFAR10_SIZE`` (default 64) training or 40 test images, 10 classes in turn (every
    class present, as the example's per-class accuracy divides by each class's count)."""

    def __init__(self, root, train=True, download=False, transform=None, target_transform=None):
        import os

        n = int(os.environ.get("STANDIN_CIFAR10_SIZE", "64")) if train else 40
        rng = numpy.random.default_rng(0 if train else 1)
        self.targets = [i % 10 for i in range(n)]
        patterns = numpy.random.default_rng(2).integers(0, 256, size=(10, 1, 1, 3))
        noise = rng.integers(-40, 40, size=(n, 32, 32, 3))
        self.data = numpy.clip(patterns[self.targets] + noise, 0, 255).astype(numpy.uint8)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image, target = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
