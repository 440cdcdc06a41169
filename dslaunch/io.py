"""``deepspeed.io``: DeepNVMe's file writers that ``torch.save`` writes into (``runtime/file_writers.py``:
each file appears whole when closed, or not at all)."""

from dslaunch.runtime.file_writers import FastFileWriter, FastFileWriterConfig, MockFileWriter, PyFileWriter

__all__ = ["FastFileWriter", "FastFileWriterConfig", "MockFileWriter", "PyFileWriter"]
