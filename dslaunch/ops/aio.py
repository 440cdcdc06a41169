"""DeepSpeed's ``deepspeed.ops.aio`` path: ``AsyncIOBuilder`` (``op_builder.py`` owns it; not
compatible here: dslaunch's NVMe offload needs no native aio op)."""

from dslaunch.ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
