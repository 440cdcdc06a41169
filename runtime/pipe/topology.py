"""DeepSpeed's ``deepspeed.runtime.pipe.topology``: its names, kept where DeepSpeed's scripts import
them. Topology and process groups for every axis (not only the pipeline's) live in
``dslaunch.runtime.parallel``; this module only re-exports them."""

from dslaunch.runtime.parallel.grid import DataParallelGrid, PipelineParallelGrid
from dslaunch.runtime.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,  # noqa: F401 (DeepSpeed's unit tests import it from here)
)

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineParallelGrid", "DataParallelGrid"]
