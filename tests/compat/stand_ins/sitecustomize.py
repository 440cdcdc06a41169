"""For DeepSpeedExamples scripts written for GPUs, run on a CPU-only torch: their
``torch.cuda.set_device(local_rank)`` (outside any DeepSpeed call) fails there with DeepSpeed as with
dslaunch; here it does nothing when torch has no CUDA. Loaded only from tests/compat/stand_ins."""

import torch

if not torch.cuda.is_available():
    torch.cuda.set_device = lambda device: None
