"""Environment propagation: exported prefixes and the .deepspeed_env / .dslaunch_env grammar."""

from pathlib import Path

import pytest

from dslaunch.errors import EnvFileError, UsageError
from dslaunch.launcher.envfile import collect_env, env_file_paths, parse_env_file


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
