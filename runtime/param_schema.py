"""Validation of free-form ``params`` dicts (``optimizer.params``, ``scheduler.params``).

ds_config gives optimizers and schedulers an open ``params`` object whose valid keys depend on
the chosen ``type``. This module owns the one way such a dict is checked: a schema of named
``Option``s (default + checker), unknown keys rejected with a did-you-mean, wrong types and
out-of-range values reported with the full key path, and Hugging Face's ``"auto"`` placeholder
explained. Used by ``optimizers.py`` and ``lr_schedules.py``; torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean

__all__ = ["Option", "REQUIRED", "check_params", "number", "integer", "boolean", "choice", "betas",
           "number_or_list"]

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
        raise ConfigError(f"must be an object of parameters for {what}, got {type(params).__name__}",
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


def _type_name(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def number(low: float | None = None, high: float | None = None, low_open: bool = False) -> Checker:
    """A real number (int or float, not bool) in [low, high] (or (low, high] when ``low_open``)."""

    def check(path: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"must be a number, got {_type_name(value)}", key=path)
        value = float(value)
        if low is not None and (value < low or (low_open and value == low)):
            raise ConfigError(f"must be {'>' if low_open else '>='} {low}, got {value}", key=path)
        if high is not None and value > high:
            raise ConfigError(f"must be <= {high}, got {value}", key=path)
        return value

    return check


def integer(low: int | None = None) -> Checker:
    """An int (not bool) >= ``low``; floats with an integral value (e.g. 1e3) are accepted."""

    def check(path: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"must be an integer, got {_type_name(value)}", key=path)
        if low is not None and value < low:
            raise ConfigError(f"must be >= {low}, got {value}", key=path)
        return value

    return check


def boolean(path: str, value: Any) -> bool:
    """true/false only: a string like "false" would silently be truthy."""
    if not isinstance(value, bool):
        raise ConfigError(f"must be true or false, got {_type_name(value)}", key=path)
    return value


def choice(*choices: str) -> Checker:
    """One of ``choices`` (exact spelling)."""

    def check(path: str, value: Any) -> str:
        if value not in choices:
            hint = did_you_mean(str(value), choices)
            raise ConfigError(f"must be one of {', '.join(choices)}, got {value!r}{hint}", key=path)
        return value

    return check


def betas(path: str, value: Any) -> tuple[float, float]:
    """A pair of coefficients in [0, 1)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"must be a list of two numbers like [0.9, 0.999], got {value!r}", key=path)
    coefficient = number(0.0, 1.0)
    pair = (coefficient(f"{path}[0]", value[0]), coefficient(f"{path}[1]", value[1]))
    for index, beta in enumerate(pair):
        if beta >= 1.0:
            raise ConfigError(f"must be < 1.0, got {beta}", key=f"{path}[{index}]")
    return pair


def number_or_list(low: float | None = None) -> Checker:
    """A number, or a list of numbers (one per optimizer param group)."""
    single = number(low)

    def check(path: str, value: Any) -> float | list[float]:
        if isinstance(value, (list, tuple)):
            return [single(f"{path}[{i}]", v) for i, v in enumerate(value)]
        return single(path, value)

    return check
