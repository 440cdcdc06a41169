"""SSH options without a network: --launcher_args parsing and its errors, the default ~/.ssh/config."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher import cli
from dslaunch.launcher.runners.ssh.options import DEFAULT_CONNECT_TIMEOUT, SSHOptions, load_config, resolve
from tests.launcher.helpers import FAKE

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("args, message", [
    ("-F 'x", "--launcher_args \"-F 'x\": no closing quotation; quote values as in a shell"),
    ("-i key\\", "--launcher_args '-i key\\\\': no escaped character"),
    ("-o ConnectTimeout=abc", "--launcher_args -o ConnectTimeout: 'abc' is not a positive number of seconds"),
    ("-o ConnectTimeout=0", "-o ConnectTimeout: '0' is not a positive number of seconds"),
    ("-o ConnectTimeout=nan", "-o ConnectTimeout: 'nan' is not a positive number of seconds"),
    ("-o ConnectTimeout=inf", "-o ConnectTimeout: 'inf' is not a positive number of seconds"),
    ("-o ConectTimeout=3", "unsupported ssh option -o 'ConectTimeout' (did you mean 'ConnectTimeout'?) "
                           "(supported: StrictHostKeyChecking, UserKnownHostsFile, ConnectTimeout"),
    ("-o Compression=yes", "unsupported ssh option -o 'Compression' (supported: "),
    ("-o StrictHostKeyChecking=maybe", "-o StrictHostKeyChecking: 'maybe' is not one of yes, ask, accept-new, no, off"),
    ("-o Port=http", "--launcher_args -o Port: 'http' is not a TCP port (1-65535)"),
    ("-o Port", "--launcher_args -o Port needs a value (-o Port=PORT)"),
    ("-o User=", "--launcher_args -o User needs a value (-o User=USER)"),
    ("-p 99999", "--launcher_args -p: '99999' is not a TCP port (1-65535)"),
    ("-p 0", "--launcher_args -p: '0' is not a TCP port"),
    ("-p ²", "--launcher_args -p: '²' is not a TCP port"),  # str.isdigit() says yes, int() says no
    ("-p", "--launcher_args: -p needs a value (-p PORT)"),
    ("-F", "--launcher_args: -F needs a value (-F FILE)"),
    ("-i", "--launcher_args: -i needs a value (-i KEY)"),
    ("-l ''", "--launcher_args: -l needs a value (-l USER)"),
    ("-o", "--launcher_args: -o needs a value (-o Key=Value)"),
    ("-X", "the ssh runner accepts -F FILE, -i KEY, -l USER, -p PORT and -o Key=Value, not '-X'"),
    ("user@host", "not 'user@host'"),
])
def test_malformed_launcher_args_are_one_line_naming_the_option(args, message):
    with pytest.raises(UsageError) as err:
        SSHOptions.from_launcher_args(args)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_value_is_reported_even_when_ssh_port_overrides_it():
    with pytest.raises(UsageError, match="-p: 'x' is not a TCP port"):
        SSHOptions.from_launcher_args("-p x", port=22)
    with pytest.raises(UsageError, match="--ssh_port 70000 is not a TCP port"):
        SSHOptions.from_launcher_args("", port=70000)


def test_attached_forms_and_spaces_like_ssh():
    opts = SSHOptions.from_launcher_args("-p2222 -oConnectTimeout=3 -lbob -i/k/id -o 'StrictHostKeyChecking no'")
    assert (opts.port, opts.connect_timeout, opts.user, opts.identity_files) == (2222, 3.0, "bob", ("/k/id",))
    assert opts.accept_new_host_keys
    assert SSHOptions.from_launcher_args("-o connecttimeout=2.5").connect_timeout == 2.5  # keys: any case


def test_bad_connect_timeout_in_the_ssh_config_names_host_and_key(tmp_path):
    config = tmp_path / "config"
    config.write_text("Host a\n  ConnectTimeout soon\n")
    with pytest.raises(UsageError, match="ssh config ConnectTimeout for a: 'soon' is not a positive number"):
        resolve("a", SSHOptions(config_file=str(config)))


def test_missing_config_file_names_the_flag(tmp_path):
    opts = SSHOptions.from_launcher_args(f"-F {tmp_path}/nope")
    with pytest.raises(UsageError, match=f"--launcher_args -F: ssh config file {tmp_path}/nope does not exist"):
        load_config(opts.config_file)


@pytest.mark.parametrize("args, message", [
    ("-F 'x", "dslaunch: error: --launcher_args \"-F 'x\": no closing quotation"),
    ("-o ConnectTimeout=abc", "dslaunch: error: --launcher_args -o ConnectTimeout: 'abc' is not a positive"),
])
def test_cli_dry_run_with_bad_launcher_args_is_one_line(tmp_path, capsys, args, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    code = cli.main(["-H", str(hostfile), "--launcher_args", args, "--dry-run", FAKE])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err, err


# -- the default ~/.ssh/config (no -F) ---------------------------------------------------------------


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh HOME with an empty ~/.ssh: what ``~`` means to the code under test."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    return tmp_path


def test_default_ssh_config_is_read_from_home(home):
    (home / ".ssh" / "config").write_text(
        "Host gpu*\n  User trainer\n  IdentityFile ~/.ssh/id_gpu\n  ConnectTimeout 9\n"
        "Host gpu1\n  HostName 10.1.2.3\n  Port 2022\n"
        "Host *\n  UserKnownHostsFile ~/.ssh/kh_all\n  StrictHostKeyChecking accept-new\n")
    config = load_config(None)
    t = resolve("gpu1", SSHOptions(), config)
    assert (t.hostname, t.port, t.user, t.connect_timeout) == ("10.1.2.3", 2022, "trainer", 9.0)
    assert t.identity_files == (str(home / ".ssh" / "id_gpu"),)
    assert t.known_hosts_files[0] == str(home / ".ssh" / "kh_all") and t.accept_new_host_keys
    other = resolve("cpu7", SSHOptions())  # no config passed: resolve reads ~/.ssh/config itself
    assert (other.hostname, other.port, other.identity_files) == ("cpu7", 22, ())
    assert other.known_hosts_files[0] == str(home / ".ssh" / "kh_all")
    cli_wins = resolve("gpu1", SSHOptions.from_launcher_args("-p 2200 -l ops -o ConnectTimeout=1"), config)
    assert (cli_wins.port, cli_wins.user, cli_wins.connect_timeout) == (2200, "ops", 1.0)


def test_no_default_ssh_config_means_ssh_defaults(home):
    t = resolve("node1", SSHOptions())
    assert (t.hostname, t.port, t.connect_timeout, t.accept_new_host_keys) == ("node1", 22, DEFAULT_CONNECT_TIMEOUT, False)
    assert t.known_hosts_files[:2] == (str(home / ".ssh" / "known_hosts"), str(home / ".ssh" / "known_hosts2"))


def test_bad_default_ssh_config_names_the_file(home):
    config = home / ".ssh" / "config"
    config.write_text("Host n1\n  Port twenty-two\n")
    with pytest.raises(UsageError, match="ssh config Port for n1: 'twenty-two' is not a TCP port"):
        resolve("n1", SSHOptions())
    config.write_text("Host n1\n  HostName\n")
    with pytest.raises(UsageError, match=f"{config}: cannot parse ssh config: Unparsable line HostName"):
        resolve("n1", SSHOptions())


def test_quoted_tilde_in_dash_f_is_the_home_directory(home):
    (home / "cluster.cfg").write_text("Host n1\n  HostName 10.9.9.9\n")
    opts = SSHOptions.from_launcher_args("-F '~/cluster.cfg'")  # quoted: no shell expanded it
    assert resolve("n1", opts).hostname == "10.9.9.9"
