"""Environment propagation: exported prefixes and the .deepspeed_env / .dslaunch_env grammar."""

import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dslaunch.errors import EnvFileError, UsageError
from dslaunch.launcher.envfile import MAX_ENV_FILE_BYTES, collect_env, env_file_paths, parse_env_file


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_grammar_comments_blank_equals_quotes_crlf(tmp_path):
    f = _write(tmp_path / ".deepspeed_env", (
        "# a comment\r\n"
        "\r\n"
        "OMP_NUM_THREADS=1\r\n"
        "  export NCCL_DEBUG = INFO  \r\n"
        "URL=http://x/?a=b&c=d#frag\r\n"
        "QUOTED=\"two words\"\n"
        "SINGLE='it''s'\n"
        "EMPTY=\n"
        "OMP_NUM_THREADS=2\n"
    ))
    assert parse_env_file(f) == {
        "OMP_NUM_THREADS": "2",  # last one wins
        "NCCL_DEBUG": "INFO",
        "URL": "http://x/?a=b&c=d#frag",
        "QUOTED": "two words",
        "SINGLE": "it''s",
        "EMPTY": "",
    }


@pytest.mark.parametrize("line, needle", [
    ("JUSTAKEY", "expected KEY=VALUE"),
    ("1BAD=x", "not a valid variable name"),
    ("A B=x", "not a valid variable name"),
    ("=x", "not a valid variable name"),
])
def test_errors_name_file_and_line(tmp_path, line, needle):
    f = _write(tmp_path / ".dslaunch_env", f"# header\nGOOD=1\r\n{line}\r\nLATER=2\n")
    with pytest.raises(EnvFileError) as err:
        parse_env_file(f)
    assert str(err.value).startswith(f"{f}:3: ")
    assert needle in str(err.value)
    assert err.value.line == 3
    assert isinstance(err.value, UsageError)  # the CLI prints it without a traceback


def test_unreadable_file_names_it(tmp_path):
    f = _write(tmp_path / ".deepspeed_env", b"A=\xff\xfe\n")
    with pytest.raises(EnvFileError, match=str(f)):
        parse_env_file(f)


def test_collect_prefixes_then_home_then_cwd(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    _write(home / ".deepspeed_env", "A=home\nB=home\nNCCL_X=file\n")
    _write(home / ".dslaunch_env", "B=home-dsl\n")
    _write(cwd / ".deepspeed_env", "C=cwd\nB=cwd\n")
    environ = {"NCCL_X": "env", "NCCL_Y": "env", "PYTHONPATH": "/p", "TORCH_HOME": "/t",
               "GLOO_SOCKET_IFNAME": "eth9", "CUDA_HOME": "/c", "UCX_A": "1", "MV2_B": "2",
               "MLFLOW_C": "3", "HOME": "/root", "PATH": "/bin", "OMP_NUM_THREADS": "4",
               "MYNCCL": "no"}
    env = collect_env(environ, cwd=cwd, home=home)
    assert env == {"NCCL_X": "file", "NCCL_Y": "env", "PYTHONPATH": "/p", "TORCH_HOME": "/t",
                   "GLOO_SOCKET_IFNAME": "eth9", "CUDA_HOME": "/c", "UCX_A": "1", "MV2_B": "2",
                   "MLFLOW_C": "3", "A": "home", "B": "cwd", "C": "cwd"}


def test_cwd_equal_to_home_reads_once_and_ds_env_file_wins(tmp_path):
    _write(tmp_path / ".deepspeed_env", "A=1\n")
    extra = _write(tmp_path / "custom.env", "A=2\n")
    assert env_file_paths(tmp_path, tmp_path, {}) == [tmp_path / ".deepspeed_env"]
    assert collect_env({"DS_ENV_FILE": str(extra)}, cwd=tmp_path, home=tmp_path) == {"A": "2"}


def test_no_files_no_prefixes_is_empty(tmp_path):
    assert collect_env({"PATH": "/bin"}, cwd=tmp_path, home=tmp_path) == {}


# ---------------------------------------------------------------- hostile files
@pytest.mark.parametrize("data, line, needle", [
    (b"A=1\nB=caf\xe9\n", 2, "not valid UTF-8 (byte 0xe9)"),
    (b"A=1\nB=x\x00y\n", 2, "holds a NUL character"),  # a NUL cannot be exported: exec() refuses it
    ("A=1\n".encode("utf-16-le"), 1, "holds a NUL character (UTF-16 without a byte-order mark?)"),
])
def test_bad_bytes_name_file_and_line(tmp_path, data, line, needle):
    f = _write(tmp_path / ".deepspeed_env", data)
    with pytest.raises(EnvFileError) as err:
        parse_env_file(f)
    assert str(err.value).startswith(f"{f}:{line}: ") and needle in str(err.value)


def test_utf16_with_bom_is_read(tmp_path):
    f = _write(tmp_path / ".deepspeed_env", b"\xff\xfe" + "A=\u00e9\r\nB=2\r\n".encode("utf-16-le"))
    assert parse_env_file(f) == {"A": "\u00e9", "B": "2"}


@pytest.mark.timeout(10)
def test_fifo_directory_and_huge_file_are_refused(tmp_path):
    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    with pytest.raises(EnvFileError, match=f"^{fifo}: is not a regular file"):
        parse_env_file(fifo)
    with pytest.raises(EnvFileError, match=f"^{tmp_path}: is a directory"):
        parse_env_file(tmp_path)
    big = tmp_path / "big.env"
    with open(big, "wb") as f:
        f.truncate(MAX_ENV_FILE_BYTES + 1)
    with pytest.raises(EnvFileError, match="is larger than 1 MiB"):
        parse_env_file(big)


def test_a_huge_bad_line_is_quoted_bounded(tmp_path):
    f = _write(tmp_path / ".deepspeed_env", "OK=1\n" + "x" * 500_000 + "\n")
    with pytest.raises(EnvFileError) as err:
        parse_env_file(f)
    assert str(err.value).startswith(f"{f}:2: expected KEY=VALUE, got 'xxx") and len(str(err.value)) < 200


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\r"])
def test_only_newline_ends_a_line_so_comments_stay_comments(tmp_path, separator):
    # str.splitlines() would split here and turn the rest of the comment into an assignment.
    f = _write(tmp_path / ".deepspeed_env", f"# note{separator}LD_PRELOAD=/tmp/evil.so\nA=x{separator}y\n")
    assert parse_env_file(f) == {"A": f"x{separator}y"}


# ---------------------------------------------------------------- properties
def _check_outcome(path: Path) -> dict[str, str] | None:
    """A valid result or exactly one EnvFileError: one bounded line naming the file."""
    try:
        env = parse_env_file(path)
    except EnvFileError as err:
        msg = str(err)
        assert msg.startswith(f"{path}:") and "\n" not in msg and len(msg) <= 1000, msg[:2000]
        return None
    for key, value in env.items():
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key)
        assert "\0" not in value and "\n" not in value
    return env


_ENV_PIECE = (st.text(max_size=5) | st.sampled_from(["\0", "\u2028", "=", "'", "\r", "\udcff"])
              | st.integers(0, 3000).map(lambda n: "x" * n))
_ENV_LINE = st.tuples(st.sampled_from(["A", "export B_1", "1X", "", "#", " C "]), st.sampled_from(["=", "", " = "]),
                      st.lists(_ENV_PIECE, max_size=4).map("".join)).map("".join)
_ENV_TEXT = st.lists(_ENV_LINE, max_size=4).map("\n".join)


@pytest.mark.timeout(60)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2000) | _ENV_TEXT.map(lambda t: t.encode(errors="surrogateescape")))
def test_random_bytes_give_a_result_or_one_clean_error(tmp_path, data):
    _check_outcome(_write(tmp_path / "fuzz.env", data))


_WEIRD = st.sampled_from(["\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x85", "\r", "=", "#", " ", "\t", "'", '"',
                          "export ", "A=1", "\u00e9"])
_FREE_TEXT = st.lists(_WEIRD | st.text(max_size=5).filter(lambda s: "\n" not in s and "\0" not in s),
                      max_size=8).map("".join)
# (None, text): a comment line; (KEY, text): an assignment.
_LINE = st.tuples(st.none() | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), _FREE_TEXT)


@pytest.mark.timeout(60)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(_LINE, max_size=10))
def test_comments_never_assign_and_values_round_trip(tmp_path, lines):
    text = "".join(f"#{body}\n" if key is None else f"{key}={body}\n" for key, body in lines)
    env = _check_outcome(_write(tmp_path / "prop.env", text))
    assert env == {key: _unquoted(body.strip()) for key, body in lines if key is not None}


def _unquoted(value: str) -> str:
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'" else value
