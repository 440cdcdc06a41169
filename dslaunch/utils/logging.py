"""DeepSpeed's ``deepspeed.utils.logger`` and ``log_dist``: the "DeepSpeed" logger, rank-aware.

The logger is stdlib ``logging``'s ``"DeepSpeed"`` logger at WARNING on stdout with a
``[time] [LEVEL] [file:line:function]`` prefix, not propagated (as DeepSpeed's; transformers sets
its level to the Trainer's log level). No torch import: the rank is read from
``torch.distributed`` only when the process already imported it.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable

__all__ = ["LoggerFactory", "logger", "log_dist", "print_dist", "log_dist_once", "get_dist_msg", "warning_once",
           "log_levels", "get_log_level_from_string", "set_log_level_from_string", "get_current_level",
           "should_log_le"]

# DeepSpeed's names of the levels (``log_level`` in the config, case-blind)
log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL}


def _make_logger(name: str, level: int = logging.WARNING) -> logging.Logger:
    made = logging.getLogger(name)
    made.setLevel(level)
    made.propagate = False
    if not made.handlers:  # importing twice (a reload) must not print every line twice
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(
            "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"))
        made.addHandler(handler)
    return made


logger = _make_logger("DeepSpeed")


class LoggerFactory:
    """DeepSpeed's ``LoggerFactory.create_logger(name, level)``: a logger of that name formatted,
    leveled and unpropagated like ``logger`` (its default level INFO, as DeepSpeed's)."""

    @staticmethod
    def create_logger(name: str | None = None, level: int = logging.INFO) -> logging.Logger:
        if name is None:
            raise ValueError("name for logger cannot be None")
        return _make_logger(name, level)


@functools.cache
def warning_once(*args: object) -> None:
    """``logger.warning`` once per distinct message."""
    logger.warning(*args)


logger.warning_once = warning_once  # type: ignore[attr-defined]  (DeepSpeed's extra method)


def get_log_level_from_string(log_level_str: str) -> int:
    """``"info"`` -> ``logging.INFO`` (any case).

    Raises:
        ValueError: not one of ``log_levels``.
    """
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str!r} is not a log level: use one of {', '.join(log_levels)}")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: logging.Logger | None = None) -> None:
    """Sets ``custom_logger`` (default: the DeepSpeed logger) and its handlers to that level."""
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    """True when the DeepSpeed logger prints messages of level ``max_log_level_str``.

    Raises:
        ValueError: not a string naming a level.
    """
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str!r} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


def _rank() -> int | None:
    """This process's rank, or None when torch.distributed is not (imported and) initialised."""
    dist = sys.modules.get("torch.distributed")
    return dist.get_rank() if dist is not None and dist.is_initialized() else None


def get_dist_msg(message: str, ranks: Iterable[int] | None = None) -> str | None:
    """``"[Rank N] message"`` if this rank should log it, else None.

    Logged when the process group is not initialised (rank shown as -1), or when ``ranks``
    holds this rank or starts with -1 (every rank). ``ranks=None`` or empty: only without a group.
    """
    rank = _rank()
    wanted = list(ranks or [])
    if rank is None or (wanted and (wanted[0] == -1 or rank in wanted)):
        return f"[Rank {-1 if rank is None else rank}] {message}"
    return None


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks ``get_dist_msg`` selects, at ``level``."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)


def print_dist(message: str, ranks: Iterable[int] | None = None) -> None:
    """As ``log_dist`` but printed, whatever the logger's level."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        print(text)


@functools.cache
def _log_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """``log_dist`` once per distinct (message, ranks, level)."""
    _log_once(message, tuple(ranks) if ranks is not None else None, level)
