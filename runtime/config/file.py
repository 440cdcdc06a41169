"""The raw ds_config document: parsed from a JSON or YAML file, and bounded in shape.

Owns the limits that keep a hostile or broken config from crashing, hanging or flooding the
output before the key-by-key validation in ``config.py`` runs:

- the file: a regular file of at most ``MAX_FILE_BYTES``, UTF-8 or UTF-16 with a BOM
  (``dslaunch.textfile``); ``.yaml``/``.yml`` in any case is YAML, anything else JSON (HJSON,
  as DeepSpeed reads it, where the ``hjson`` package is installed);
- YAML aliases (``*name``) are refused: a few hundred bytes of nested aliases expand to
  billions of values (the "billion laughs");
- integer literals of more than ``_MAX_INT_DIGITS`` digits become ``HugeInt``, which the key's
  checker then reports (Python itself refuses to parse more than 4300 digits);
- any document, a file's or a dict given to ``initialize``: string keys, at most ``MAX_DEPTH``
  levels of nesting and ``MAX_VALUES`` values (a real ds_config has a few dozen).

Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from dslaunch.errors import ConfigError, shorten
from dslaunch.runtime.config.param_schema import HugeInt, describe
from dslaunch.textfile import Fail, read_text

__all__ = ["read_config_file", "check_shape", "MAX_FILE_BYTES", "MAX_DEPTH", "MAX_VALUES"]

MAX_FILE_BYTES = 16 * 2**20
MAX_DEPTH = 64
MAX_VALUES = 100_000
_MAX_INT_DIGITS = 1000  # far above any valid setting (counts stop at 1e12)
_YAML_SUFFIXES = (".yaml", ".yml")


def read_config_file(path: Path) -> Any:
    """The parsed document of a config file (any type; the caller checks it is an object).

    Raises:
        ConfigError: unreadable, too large, not UTF-8/UTF-16, invalid JSON/YAML, a YAML alias,
            or nested deeper than ``MAX_DEPTH``; names the file and, where known, the line.
    """
    where = str(path)

    def fail(message: str, line: int | None) -> ConfigError:
        return ConfigError(message if line is None else f"line {line}: {message}", source=where)

    text = read_text(path, MAX_FILE_BYTES, fail)
    if path.suffix.lower() in _YAML_SUFFIXES:
        return _load_yaml(text, fail)
    try:
        try:
            return json.loads(text, parse_int=_parse_int, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as err:
            return _load_hjson(text, err, fail)
    except _DuplicateKey as dup:
        raise fail(f"the key {shorten(repr(dup.key), 120)} is given twice in one object (the later one would "
                   "silently win; DeepSpeed refuses it too): keep one", None) from None
    except RecursionError:  # the C decoder's own depth guard, far below the file size limit
        raise fail(f"nested deeper than {MAX_DEPTH} levels", None) from None


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; a key given twice raises (a plain dict keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _load_hjson(text: str, json_error: json.JSONDecodeError, fail: Fail) -> Any:
    """DeepSpeed reads config files as HJSON (comments, unquoted keys, trailing commas): so does
    dslaunch where the ``hjson`` package is installed (DeepSpeed requires it; the ``hjson`` extra)."""
    try:
        import hjson
    except ImportError:
        raise fail(f"invalid JSON at column {json_error.colno}: {shorten(json_error.msg, 200)} (DeepSpeed also "
                   "reads HJSON: pip install hjson to read this file as it does)", json_error.lineno) from None
    try:
        return hjson.loads(text, parse_int=_parse_int, object_pairs_hook=_unique_keys)
    except hjson.HjsonDecodeError as err:
        raise fail(f"invalid JSON/HJSON at column {err.colno}: {shorten(err.msg, 200)}", err.lineno) from None
    except (OverflowError, ValueError) as err:  # hjson's own number scan: int(float("inf")) for 1e999
        raise fail(f"invalid JSON/HJSON: a number out of range ({shorten(str(err), 120)}); numbers must be finite",
                   None) from None
    except RecursionError:
        raise fail(f"nested deeper than {MAX_DEPTH} levels", None) from None


def _parse_int(text: str) -> int | HugeInt:
    digits = len(text.lstrip("+-"))
    return HugeInt(digits) if digits > _MAX_INT_DIGITS else int(text)


def _load_yaml(text: str, fail: Fail) -> Any:
    import yaml

    loader = _yaml_loader()
    try:
        _check_yaml_events(yaml.parse(text, Loader=loader), fail)
        return yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        problem = shorten(str(err.problem or err.context), 200)
        if "nesting depth" in problem:  # libyaml's own limit (PyYAML >= 6.0.4): its scanner runs ahead
            raise fail(f"nested deeper than {MAX_DEPTH} levels", mark and mark.line + 1) from None
        if mark is None:
            raise fail(f"invalid YAML: {problem}", None) from None
        raise fail(f"invalid YAML at column {mark.column + 1}: {problem}", mark.line + 1) from None
    except yaml.YAMLError as err:
        raise fail(f"invalid YAML: {shorten(str(err), 200)}", None) from None


def _check_yaml_events(events: Iterable[Any], fail: Fail) -> None:
    """Refuse aliases, deep nesting and too many values before anything is built."""
    import yaml

    depth = values = 0
    for event in events:
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise fail(f"YAML aliases (*{shorten(event.anchor, 40)}) are not accepted in a config; "
                       "write the value out", line)
        if isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.NodeEvent):
            values += 1
            if values > MAX_VALUES:
                raise fail(f"holds more than {MAX_VALUES} values; a ds_config has a few dozen", line)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise fail(f"nested deeper than {MAX_DEPTH} levels", line)


@cache
def _yaml_loader() -> type:
    """A SafeLoader (libyaml's when available) whose scalar constructors cannot raise a traceback.

    YAML's explicit tags (``!!int abc``, ``!!bool maybe``) and date-like plain scalars
    (``2001-13-45``) make PyYAML's constructors raise ValueError/KeyError without a position.
    """
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    loader = type("_ConfigLoader", (base,), {})

    def marked(construct: Any) -> Any:
        def wrapped(self: Any, node: Any) -> Any:
            try:
                return construct(self, node)
            except (ValueError, LookupError, ArithmeticError, TypeError):
                kind = node.tag.rpartition(":")[2]
                raise yaml.constructor.ConstructorError(
                    None, None, f"not a valid {kind}: {shorten(repr(node.value), 60)}", node.start_mark) from None
        return wrapped

    def construct_int(self: Any, node: Any) -> Any:
        value = self.construct_scalar(node)
        digits = sum(c.isdigit() for c in value) if isinstance(value, str) else 0
        return HugeInt(digits) if digits > _MAX_INT_DIGITS else base.construct_yaml_int(self, node)

    for tag, construct in (("int", construct_int), ("float", base.construct_yaml_float),
                           ("bool", base.construct_yaml_bool), ("timestamp", base.construct_yaml_timestamp)):
        loader.add_constructor(f"tag:yaml.org,2002:{tag}", marked(construct))
    return loader


def check_shape(raw: Any, source: str | None) -> None:
    """Bound any document: string keys, ``MAX_DEPTH`` levels, ``MAX_VALUES`` values.

    Iterative, so a 200 000-level dict (or one that contains itself) is reported, not a
    RecursionError; values shared between keys count each time they appear.

    Raises:
        ConfigError: naming the key path where the limit was hit.
    """
    stack: list[tuple[Any, str, int]] = [(raw, "", 0)]
    values = 0
    while stack:
        value, path, depth = stack.pop()
        is_map = isinstance(value, Mapping)
        if not (is_map or isinstance(value, (list, tuple))):
            continue
        if depth >= MAX_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_DEPTH} levels", key=path, source=source)
        values += len(value)
        if values > MAX_VALUES:
            raise ConfigError(f"holds more than {MAX_VALUES} values; a ds_config has a few dozen",
                              key=path or None, source=source)
        for key, child in (value.items() if is_map else enumerate(value)):
            if is_map and not isinstance(key, str):
                raise ConfigError(f"keys must be strings, got {describe(key)}", key=path or None,
                                  source=source)
            child_path = (f"{path}.{key}" if path else key) if is_map else f"{path}[{key}]"
            stack.append((child, child_path, depth + 1))
