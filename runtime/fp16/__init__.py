"""DeepSpeed's ``deepspeed.runtime.fp16`` paths: its fp16 optimizer wrappers are dslaunch's
precision policy (``runtime/precision``), which owns the 16-bit model, fp32 master and loss scale."""
