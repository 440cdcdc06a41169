"""``deepspeed.utils.zero_to_torch`` (DeepSpeed 0.19.8): ``zero_to_fp32`` with a required ``--dtype``
(float32, float16 or bfloat16; non-floating buffers keep theirs):
``python -m dslaunch.utils.zero_to_torch CHECKPOINT_DIR OUTPUT_DIR --dtype bf16``. Same options,
checks and output layout as ``zero_to_fp32`` (``dslaunch.runtime.export_cli``)."""

from __future__ import annotations

from dslaunch.runtime.export_cli import check_arguments, run_as_script

__all__ = ["main"]


def main(args: list[str] | None = None) -> None:
    """DeepSpeed's entry, callable from Python: parse ``args`` (``sys.argv[1:]`` when None) and
    convert; bad input raises dslaunch's one-line error (``python -m`` prints it and exits)."""
    from dslaunch.runtime.checkpoint.export import run

    run(check_arguments(args, with_dtype=True))


if __name__ == "__main__":
    run_as_script(with_dtype=True)
