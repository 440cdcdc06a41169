"""Validation of free-form ``params`` dicts (``optimizer.params``, ``scheduler.params``).

ds_config gives optimizers and schedulers an open ``params`` object whose valid keys depend on
the chosen ``type``. This module owns the one way such a dict is checked: a schema of named
``Option``s (default + checker), unknown keys rejected with a did-you-mean, wrong types and
out-of-range values reported with the full key path, and Hugging Face's ``"auto"`` placeholder
explained. Used by ``optim.registry`` and ``lr_schedules``; torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean, quote

__all__ = ["Option", "REQUIRED", "check_params", "number", "integer", "boolean", "string", "choice", "betas",
           "number_or_list", "finite", "describe", "HugeInt", "INT_MAX"]

# Marks an option that has no default and must be given.
REQUIRED: Any = object()

Checker = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Option:
    """One accepted key: its default (or ``REQUIRED``) and a checker returning the clean value."""

    default: Any
    check: Checker


def check_params(params: Mapping[str, Any] | None, schema: Mapping[str, Option], key_prefix: str,
                 what: str) -> dict[str, Any]:
    """Validate ``params`` against ``schema`` and fill in defaults.

    Args:
        params: the user's dict (``None`` means empty).
        schema: accepted keys.
        key_prefix: key path used in messages, e.g. ``"optimizer.params"``.
        what: the thing configured, for messages, e.g. ``"optimizer 'Adam'"``.

    Returns:
        A new dict with every schema key, user values checked and converted.

    Raises:
        ConfigError: unknown key (with did-you-mean and the valid keys), missing required key,
            wrong type or out-of-range value; the message names ``<key_prefix>.<key>``.
    """
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"must be an object of parameters for {what}, got {describe(params)}",
                          key=key_prefix)
    out: dict[str, Any] = {}
    for key, value in params.items():
        option = schema.get(key)
        path = f"{key_prefix}.{key}"
        if option is None:
            raise ConfigError(f"unknown parameter for {what}{did_you_mean(str(key), schema)}; "
                              f"valid parameters: {', '.join(sorted(schema))}", key=path)
        if isinstance(value, str) and value == "auto":
            raise ConfigError("'auto' is a Hugging Face Trainer placeholder that only the Trainer fills "
                              "in; put the actual value here (or remove the key to use the default)",
                              key=path)
        out[key] = option.check(path, value)
    for key, option in schema.items():
        if key in out:
            continue
        if option.default is REQUIRED:
            raise ConfigError(f"is required for {what}", key=f"{key_prefix}.{key}")
        out[key] = option.default
    return out


# Counts (steps, sizes, windows) are capped: no real run needs more, and an absurd value must
# fail here, not as an overflow in torch or a tensor allocation later.
INT_MAX = 10**12


class HugeInt:
    """An integer literal too long to convert (a config file's 5000-digit number).

    Python refuses to parse decimal literals over 4300 digits; the file readers put this in its
    place so that the checker of its key reports it, naming the key. No setting accepts it.
    """

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<{self.digits}-digit integer>"


def describe(value: Any) -> str:
    """The type and (bounded) value of a user's value, for "got ..." in messages."""
    if isinstance(value, HugeInt):
        return f"a {value.digits}-digit integer"
    return f"{type(value).__name__} {quote(value)}"


def _bound(x: float) -> str:
    if x == int(x) and abs(x) >= 2**20 and math.log2(abs(x)).is_integer():
        return f"{'-' if x < 0 else ''}2**{int(math.log2(abs(x)))}"
    return re.sub(r"e\+?(-?)0*(\d)", r"e\1\2", f"{x:.6g}")  # 1e+08 -> 1e8


def _span(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """``in [0, 1)``, ``> 0 and finite``, ``finite``: the accepted range, in words."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_bound(low)} and finite"
    if high is not None:
        return f"{'<' if high_open else '<='} {_bound(high)} and finite"
    return "finite"


def number(low: float | None = None, high: float | None = None, low_open: bool = False,
           high_open: bool = False) -> Checker:
    """A finite real number (int or float, not bool) in [low, high]; ``*_open`` excludes a bound.

    NaN and +-inf are always refused: a NaN lr or clip norm trains to NaN weights silently, an
    infinite loss scale skips every step.
    """
    span = _span(low, high, low_open, high_open)

    def check(path: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"must be a number {span}, got {describe(value)}", key=path)
        try:
            x = float(value)
        except OverflowError:  # an int beyond the float range
            x = math.inf
        if not (math.isfinite(x) and _within(x, low, high, low_open, high_open)):
            raise ConfigError(f"must be {span}, got {describe(value)}", key=path)
        return x

    return check


def _within(x: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or (x > low if low_open else x >= low)
    below = high is None or (x < high if high_open else x <= high)
    return above and below


def integer(low: int = 0, high: int = INT_MAX) -> Checker:
    """An int (not bool) in [low, high]; floats with an integral value (e.g. 1e3) are accepted."""
    span = f"an integer in [{_bound(low)}, {_bound(high)}]"

    def check(path: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(f"must be {span}, got {describe(value)}", key=path)
        return value

    return check


def finite(path: str, value: Any) -> Any:
    """Any value, but a number in it (also inside a list) must be finite; kept as given.

    For the keyword arguments of a ``torch.optim`` class named by type, whose ranges torch owns.
    """
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            finite(f"{path}[{i}]", item)
    elif isinstance(value, (int, float, HugeInt)) and not isinstance(value, bool):
        number()(path, value)
    return value


def boolean(path: str, value: Any) -> bool:
    """true/false, or 1/0 as DeepSpeed reads them (its tests write ``"zero_allow_untested_optimizer":
    1``); nothing else: a string like "false" would silently be truthy."""
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false (or 1 or 0), got {describe(value)}", key=path)
    return value


def string(path: str, value: Any) -> str:
    """Any string (a name, a prefix)."""
    if not isinstance(value, str):
        raise ConfigError(f"must be a string, got {describe(value)}", key=path)
    return value


def choice(*choices: str) -> Checker:
    """One of ``choices`` (exact spelling)."""

    def check(path: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            hint = did_you_mean(value, choices) if isinstance(value, str) else ""
            raise ConfigError(f"must be one of {', '.join(choices)}, got {quote(value)}{hint}", key=path)
        return value

    return check


def betas(path: str, value: Any) -> tuple[float, float]:
    """A pair of coefficients in [0, 1)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"must be a list of two numbers like [0.9, 0.999], got {describe(value)}", key=path)
    return _COEFFICIENT(f"{path}[0]", value[0]), _COEFFICIENT(f"{path}[1]", value[1])


# A momentum / beta: 1 would divide by zero in Adam's bias correction.
_COEFFICIENT = number(0.0, 1.0, high_open=True)


def number_or_list(low: float | None = None, high: float | None = None, high_open: bool = False) -> Checker:
    """A number, or a list of numbers (one per optimizer param group); ranges as ``number``."""
    single = number(low, high, high_open=high_open)

    def check(path: str, value: Any) -> float | list[float]:
        if isinstance(value, (list, tuple)):
            return [single(f"{path}[{i}]", v) for i, v in enumerate(value)]
        return single(path, value)

    return check
