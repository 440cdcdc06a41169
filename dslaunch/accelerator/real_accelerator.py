"""``deepspeed.accelerator.real_accelerator``: where DeepSpeed defines ``get_accelerator`` (some
scripts import it from here); dslaunch's is ``dslaunch.runtime.accelerator``'s."""

from dslaunch.runtime.accelerator import get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported"]
