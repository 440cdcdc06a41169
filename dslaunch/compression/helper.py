"""``deepspeed.compression.helper``: getting and setting a submodule by dotted name (plain module
surgery scripts use on their own; ``dslaunch.utils.module_utils``, where DeepSpeed 0.19.8 moved
them); the compression-specific conversion is refused on use."""

from __future__ import annotations

from dslaunch.compression.compress import COMPRESSION
from dslaunch.utils.module_utils import recursive_getattr, recursive_setattr
from dslaunch.utils.refused import refused_function

__all__ = ["recursive_getattr", "recursive_setattr", "convert_conv1d_to_linear"]


convert_conv1d_to_linear = refused_function(__name__, "convert_conv1d_to_linear", COMPRESSION)
