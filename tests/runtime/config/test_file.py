"""Config files and documents that are broken or hostile: one bounded line, never a traceback or a hang."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.file import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES

pytestmark = pytest.mark.timeout(60)


def _error(source: object, world: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, world)
    msg = str(info.value)
    assert "\n" not in msg and len(msg) <= 1000, msg[:2000]
    return msg


def _file(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# ---------------------------------------------------------------- encodings
def test_latin1_byte_names_file_and_line(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.json", b'{\n"train_batch_size": 2,\n"x": "caf\xe9"}')
    assert _error(path) == f"{path}: line 3: not valid UTF-8 (byte 0xe9); save the file as UTF-8"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-8-sig"])
def test_byte_order_marks_are_honoured(tmp_path: Path, encoding: str) -> None:
    text = '{"train_batch_size": 4, "zero_optimization": {"stage": 1}}'
    bom = {"utf-16-le": b"\xff\xfe", "utf-16-be": b"\xfe\xff"}.get(encoding, b"")
    path = _file(tmp_path, "c.json", bom + text.encode(encoding))  # PowerShell writes UTF-16LE + BOM
    assert load_config(path, 2).zero_optimization.stage == 1


def test_utf16_without_bom_is_named(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.json", '{"train_batch_size": 4}'.encode("utf-16-le"))
    assert "line 1: holds a NUL character (UTF-16 without a byte-order mark?)" in _error(path)


# ---------------------------------------------------------------- format and type
@pytest.mark.parametrize("name", ["c.YAML", "c.Yml", "c.yaml"])
def test_yaml_suffix_in_any_case_is_yaml(tmp_path: Path, name: str) -> None:
    path = _file(tmp_path, name, "train_batch_size: 4\nzero_optimization:\n  stage: 2\n")
    assert load_config(path, 2).zero_optimization.stage == 2


@pytest.mark.parametrize("config, got", [([1, 2, 3], "got list [1, 2, 3]"), (7, "got int 7"),
                                         (b"c.json", "got bytes b'c.json'")])
def test_config_of_the_wrong_type_says_what_it_takes(config: object, got: str) -> None:
    msg = _error(config)
    assert msg == f"initialize(config=...) takes a dict or a path to a JSON/YAML file, {got}"


def test_no_config_at_all() -> None:
    for source in (None, "", argparse.Namespace(), argparse.Namespace(deepspeed_config=None)):
        assert _error(source).startswith("no DeepSpeed config given")


def test_file_holding_a_list_is_named(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.json", "[1, 2, 3]")
    assert _error(path).startswith(f"{path}: must hold an object of settings")


# ---------------------------------------------------------------- size, depth, numbers
def test_an_infinite_hjson_number_is_one_line(tmp_path: Path) -> None:
    """hjson (the fallback for what is not JSON) turns 1e999 into int(inf): one line, not its
    OverflowError (found by test_fuzz)."""
    pytest.importorskip("hjson")
    path = tmp_path / "ds.json"
    path.write_text("{train_batch_size: 1e999}")
    with pytest.raises(ConfigError, match="a number out of range") as err:
        load_config(str(path), 1)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_5000_digit_integer_names_the_key(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.json", '{"train_batch_size": ' + "9" * 5000 + "}")
    assert _error(path) == (f"{path}: 'train_batch_size': must be an integer in [1, 1e12], "
                            "got a 5000-digit integer")
    path = _file(tmp_path, "c.yaml", "train_batch_size: 2\ngradient_clipping: -" + "9" * 5000 + "\n")
    assert _error(path).startswith(f"{path}: 'gradient_clipping': must be a number >= 0 and finite, "
                                   "got a 5000-digit integer")


@pytest.mark.parametrize("name, text", [
    ("deep.json", '{"aio": ' + "[" * 200_000 + "]" * 200_000 + "}"),
    ("deep.yaml", "aio: " + "[" * 200_000 + "]" * 200_000 + "\n"),
    ("deep2.json", '{"aio": ' + '{"a": ' * 65 + "1" + "}" * 65 + "}"),
])
def test_deep_nesting_is_refused(tmp_path: Path, name: str, text: str) -> None:
    assert f"nested deeper than {MAX_DEPTH} levels" in _error(_file(tmp_path, name, text))


def test_nesting_up_to_the_limit_is_accepted(tmp_path: Path) -> None:
    depth = MAX_DEPTH - 1  # plus the top-level object
    path = _file(tmp_path, "ok.json", '{"train_batch_size": 2, "zero_force_ds_cpu_optimizer": ' + "[" * depth + "]" * depth + "}")
    assert load_config(path, 1).train_batch_size == 2


def test_a_file_over_the_size_limit_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse
    assert _error(path) == f"{path}: is larger than 16 MiB; this file is expected to be small"


def test_directory_and_fifo_are_refused_without_hanging(tmp_path: Path) -> None:
    assert _error(tmp_path) == f"{tmp_path}: is a directory, not a file"
    fifo = tmp_path / "c.json"
    os.mkfifo(fifo)  # opening a FIFO for reading would wait for a writer forever
    assert "is not a regular file" in _error(fifo)


# ---------------------------------------------------------------- YAML specifics
def _alias_bomb(levels: int) -> str:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefghi"[:levels], "bcdefghij"[:levels], strict=True):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    bomb = _alias_bomb(8)
    assert len(bomb) < 600  # 9**9 values once expanded
    path = _file(tmp_path, "bomb.yaml", bomb)
    start = time.monotonic()
    assert _error(path) == (f"{path}: line 2: YAML aliases (*a) are not accepted in a config; "
                            "write the value out")
    assert time.monotonic() - start < 5.0  # expanding it would take minutes; 5 s holds at load 10


def test_yaml_merge_of_an_alias_is_refused_too(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.yaml", "base: &b {stage: 1}\nzero_optimization:\n  <<: *b\n")
    assert "line 3: YAML aliases (*b) are not accepted" in _error(path)


@pytest.mark.parametrize("text, line", [
    ("train_batch_size: !!int abc\n", 1),
    ("train_batch_size: 2\nx: !!int\n", 2),  # empty: IndexError inside PyYAML
    ("train_batch_size: 2\nfp16: {enabled: !!bool maybe}\n", 2),
    ("train_batch_size: 2\n\nwhen: 2001-13-45\n", 3),  # date-like plain scalar
    ("train_batch_size: 2\nx: !!float 1.2.3\n", 2),
])
def test_yaml_scalars_that_cannot_be_built_are_one_line(tmp_path: Path, text: str, line: int) -> None:
    path = _file(tmp_path, "c.yaml", text)
    assert _error(path).startswith(f"{path}: line {line}: invalid YAML at column ")


def test_yaml_syntax_error_is_one_line_with_position(tmp_path: Path) -> None:
    path = _file(tmp_path, "c.yaml", "train_batch_size: 2\nzero_optimization:\n  stage: [1\n")
    assert _error(path).startswith(f"{path}: line 4: invalid YAML at column 1: ")


# ---------------------------------------------------------------- dict documents
def test_a_dict_nested_200k_levels_is_refused() -> None:
    deep: list = []
    inner = deep
    for _ in range(200_000):
        inner.append([])
        inner = inner[0]
    # in a section, its repr in the error was a RecursionError
    msg = _error({"train_batch_size": 2, "fp16": deep})
    assert msg.startswith("'fp16[0][0][0]") and msg.endswith(f"...': nested deeper than {MAX_DEPTH} levels")


def test_a_dict_that_contains_itself_is_refused() -> None:
    cyclic: dict = {"train_batch_size": 2}
    cyclic["aio"] = cyclic
    assert f"nested deeper than {MAX_DEPTH} levels" in _error(cyclic)


def test_shared_values_count_each_time() -> None:
    bomb: list = ["x"] * 9
    for _ in range(8):
        bomb = [bomb] * 9  # the dict form of a YAML alias bomb: 9**9 values
    assert f"holds more than {MAX_VALUES} values" in _error({"train_batch_size": 2, "aio": bomb})


@pytest.mark.parametrize("key", [1, None, 2.5, True, (1, 2)])
def test_keys_must_be_strings(key: object) -> None:
    msg = _error({"train_batch_size": 2, "zero_optimization": {key: 1}})
    assert msg.startswith("'zero_optimization': keys must be strings, got ")


# ---------------------------------------------------------------- bounded messages
@pytest.mark.parametrize("raw", [
    {"fp16": ["x" * 10**6]},
    {"zero_optimization": {"stage": list(range(10**4))}},
    {"optimizer": {"type": "x" * 10**6}},
    {"scheduler": {"type": "x" * 10**6}},
    {"optimizer": {"type": "Adam", "params": {"betas": "x" * 10**6}}},
    {"checkpoint": {"tag_validation": "y" * 10**6}},
    {"x" * 10**6: 1},
    {"line\nbreak\u2028and\x1b[31mcolour": 1},
    {"optimizer": {"type": "Adam", "params": {"\n" * 10**5: 1}}},
])
def test_messages_quote_user_values_bounded_on_one_line(raw: dict) -> None:
    msg = _error({"train_batch_size": 2, **raw})
    assert len(msg) <= 600 and msg.isprintable(), msg


# ---------------------------------------------------------------- HJSON (DeepSpeed reads config files with hjson)
HJSON = """{
  # the batch
  train_batch_size: 8
  "gradient_accumulation_steps": 2,  // trailing commas, comments, quoteless keys and strings
  optimizer: {
    type: Adam
    params: {lr: 0.001,},
  },
}
"""


def test_an_hjson_config_file_reads_as_deepspeed_reads_it(tmp_path: Path) -> None:
    cfg = load_config(_file(tmp_path, "c.json", HJSON), 2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.train_micro_batch_size_per_gpu) == (8, 2, 2)
    assert cfg.optimizer.name == "Adam" and cfg.optimizer.params["lr"] == 0.001
    bad = _file(tmp_path, "bad.json", '{\n"train_batch_size": 2,\n"fp16": {enabled: true\n')
    assert _error(bad).startswith(f"{bad}: line "), _error(bad)
    assert "invalid JSON/HJSON at column" in _error(bad)


def test_without_hjson_a_non_json_file_says_how_deepspeed_reads_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "hjson", None)  # import hjson fails
    path = _file(tmp_path, "c.json", HJSON)
    msg = _error(path)
    assert msg.startswith(f"{path}: line 2: invalid JSON at column 3: ") and "pip install hjson" in msg, msg


@pytest.mark.parametrize("text", ['{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}',
                                  '{\n "train_batch_size": 24,\n "train_batch_size": 24,\n}\n'],  # HJSON: trailing comma
                         ids=["json", "hjson"])
def test_a_key_given_twice_is_refused_not_last_wins(tmp_path: Path, text: str) -> None:
    pytest.importorskip("hjson")
    path = _file(tmp_path, "c.json", text)
    message = _error(path)
    assert message.startswith(f"{path}: the key ") and "is given twice in one object" in message, message
