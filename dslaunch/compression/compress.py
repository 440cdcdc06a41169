"""``deepspeed.compression.compress``: ``init_compression``, ``redundancy_clean``,
``student_initialization`` (from ``dslaunch.runtime.compression.compress``)."""

from dslaunch.runtime.compression.compress import init_compression, redundancy_clean, student_initialization

__all__ = ["init_compression", "redundancy_clean", "student_initialization"]
