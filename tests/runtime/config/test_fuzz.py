"""Property tests: any bytes as a config file, any JSON-like structure as ``config=``.

Whatever comes in, ``load_config`` (what ``initialize`` calls) returns a valid config whose
numbers are all finite, or raises exactly one ``ConfigError`` whose message is one bounded,
printable line; never another exception, and each example within a deadline.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dslaunch.errors import ConfigError
from dslaunch.runtime import lr_schedules
from dslaunch.runtime.config import DeepSpeedConfig, load_config
from dslaunch.runtime.config import ds_config as config_module
from dslaunch.runtime.config.sections import (
    UNIMPLEMENTED_KEYS,
    Bf16Config,
    CheckpointConfig,
    Fp16Config,
)
from dslaunch.runtime.config.zero import ZeroConfig
from dslaunch.runtime.optim import registry as optimizers

pytestmark = pytest.mark.timeout(60)
_FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


def _outcome(source: Any, world: int) -> None:
    try:
        cfg = load_config(source, world)
    except ConfigError as err:
        msg = str(err)
        assert msg.isprintable() and len(msg) <= 1000, msg[:2000]
        return
    assert isinstance(cfg, DeepSpeedConfig)
    _assert_finite(dataclasses.asdict(cfg))


def _assert_finite(value: Any) -> None:
    if isinstance(value, float):
        assert math.isfinite(value)
    elif isinstance(value, dict):
        for item in value.values():
            _assert_finite(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _assert_finite(item)


# ---------------------------------------------------------------- JSON-like structures
def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)] + list(cls.UNIMPLEMENTED)


_NUMBERS = (st.sampled_from([0, 1, 2, -1, 3, 64, 65, 0.5, 0.999, 1.0, 1e8, 1e12, 10**12 + 1, 2.0**64, 1e-300, 1e308])
            | st.sampled_from([400, -400, 5000]).map(lambda e: 10 ** abs(e) * (1 if e > 0 else -1)))
_LEAF = (st.none() | st.booleans() | st.integers() | st.floats() | _NUMBERS | st.text(max_size=8)
         | st.sampled_from(["auto", "none", "cpu", "fp16", "bf16", "fail", "log", "linear", "Adam"]))
_ODD_KEY = st.text(max_size=8) | st.integers() | st.none() | st.booleans() | st.floats()


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


_SHALLOW_VALUE = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=4)
                              | st.dictionaries(_ODD_KEY | st.sampled_from(["enabled", "device", "stage"]), inner,
                                                max_size=4), max_leaves=12)
_VALUE = _SHALLOW_VALUE | st.integers(0, 3000).map(_deep)


def _document(value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict]:
    """A ds_config-like dict: mostly known keys (so validation goes deep), some odd ones."""

    def section(keys: list[str]) -> st.SearchStrategy[dict]:
        return st.dictionaries(st.sampled_from(keys) | _ODD_KEY, value, max_size=6)

    def typed(types: list[str], params: list[str]) -> st.SearchStrategy[dict]:
        return st.fixed_dictionaries({}, optional={"type": st.sampled_from(types) | _LEAF,
                                                   "params": section(params) | value})

    batch = st.sampled_from([1, 2, 4, 8]) | _LEAF
    known = st.fixed_dictionaries({}, optional={
        "train_batch_size": batch, "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": batch,
        "zero_optimization": section(_names(ZeroConfig) + ["stage3_prefetch_bucket_size"]),
        "fp16": section(_names(Fp16Config)), "bf16": section(_names(Bf16Config)),
        "checkpoint": section(_names(CheckpointConfig)),
        "optimizer": typed([*optimizers.OPTIMIZER_TYPES, "RMSprop", "Adamax", "MuAdam"], _OPT_PARAMS),
        "scheduler": typed(list(lr_schedules.SCHEDULER_TYPES), _SCHED_PARAMS),
        **{key: value for key in config_module._SCALARS if key not in config_module.BATCH_KEYS},
    })
    odd = st.dictionaries(st.sampled_from([*UNIMPLEMENTED_KEYS, "bfloat16"]) | _ODD_KEY, value, max_size=3)
    return st.tuples(known, odd).map(lambda parts: {**parts[1], **parts[0]})


_OPT_PARAMS = sorted({k for e in optimizers._ENTRIES for k in e.schema} | {"alpha", "rho", "momentum_decay"})
_SCHED_PARAMS = sorted({k for e in lr_schedules._REGISTRY.values() for k in e.schema})


@_FUZZ
@given(document=_document(_VALUE) | _VALUE, world=st.sampled_from([1, 2]))
def test_any_structure_as_config(document: Any, world: int) -> None:
    _outcome(document, world)


# ---------------------------------------------------------------- bytes as a file
def _json_text(document: Any) -> str:
    def keys_as_text(value: Any) -> Any:  # JSON has only string keys
        if isinstance(value, dict):
            return {str(k): keys_as_text(v) for k, v in value.items()}
        return [keys_as_text(v) for v in value] if isinstance(value, list) else value
    try:
        return json.dumps(keys_as_text(document))
    except ValueError:  # an int over 4300 digits cannot be written either
        return '{"train_batch_size": ' + "9" * 5000 + "}"


def _yaml_text(document: Any) -> str:
    try:
        return yaml.safe_dump(document)
    except (yaml.YAMLError, ValueError):  # unrepresentable (a 5000-digit int): any text will do
        return "train_batch_size: " + "9" * 5000


def _mutate(text_and_edits: tuple[str, list[tuple[int, bytes]]]) -> bytes:
    data = bytearray(text_and_edits[0].encode())
    for position, inserted in text_and_edits[1]:
        position %= len(data) + 1
        data[position:position + 1] = inserted  # replace one byte (or delete it)
    return bytes(data)


_SHALLOW = _document(_SHALLOW_VALUE)
_EDITS = st.lists(st.tuples(st.integers(0, 10**6), st.binary(max_size=3)), max_size=4)
_YAML_ALPHABET = st.lists(st.sampled_from(list("{}[]:,-&*!|>'\"#?% \n\t01.xe") + ["!!int ", "<<: ", "\ufeff"]),
                          max_size=100).map("".join)
_FILE_BYTES = (st.binary(max_size=500)
               | st.tuples(_SHALLOW.map(_json_text), _EDITS).map(_mutate)
               | st.tuples(_SHALLOW.map(_yaml_text), _EDITS).map(_mutate)
               | _YAML_ALPHABET.map(str.encode)
               | _SHALLOW.map(_json_text).map(lambda t: t.encode("utf-16")))


@_FUZZ
@given(data=_FILE_BYTES, suffix=st.sampled_from([".json", ".yaml", ".YML", ".txt"]))
def test_any_bytes_as_config_file(tmp_path: Path, data: bytes, suffix: str) -> None:
    path = tmp_path / f"ds_config{suffix}"
    path.write_bytes(data)
    _outcome(path, 1)
