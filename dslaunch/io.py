"""``deepspeed.io``: DeepNVMe's file writers, refused on use (dslaunch writes checkpoints itself,
``runtime/checkpoint``; its NVMe offload is ``offload_optimizer``/``offload_param`` in ds_config)."""

from dslaunch.utils.refused import Refusal, refuse

DEEPNVME_IO = Refusal("DeepNVMe's file writers (deepspeed.io)",
                      "save with engine.save_checkpoint or torch.save; NVMe offload is ds_config's offload_* 'nvme'")

_REFUSED = ("FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter")
globals().update(refuse(__name__, _REFUSED, DEEPNVME_IO))

__all__ = ["DEEPNVME_IO", *_REFUSED]
