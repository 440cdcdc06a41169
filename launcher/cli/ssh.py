"""``dslaunch ssh [-f HOSTFILE] COMMAND...``: run a shell command on every host of a hostfile.

DeepSpeed's ``ds_ssh`` (the ``deepspeed`` distribution installs that name for this command): the
hosts are the hostfile's (default ``/job/hostfile``), narrowed by ``--include``/``--exclude`` as a
launch would; each host's lines come back prefixed ``host: ``. The exit code is the largest of the
hosts' (255 for a host that could not be reached), and a failure names its hosts on stderr;
``ds_ssh`` runs ``pdsh`` without ``-S`` and exits 0 whatever the hosts answered. A thin click
command: the SSH work is ``runners.ssh.every_host``.
"""

from __future__ import annotations

import sys

import click

from dslaunch.errors import shorten
from dslaunch.launcher.hostfile import apply_filter, read_hostfile
from dslaunch.launcher.plan import DEFAULT_HOSTFILE

__all__ = ["command", "ds_ssh"]


@click.command("ssh", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-f", "-H", "--hostfile", default=DEFAULT_HOSTFILE, show_default=True,
              help="hostfile ('host slots=N' lines)")
@click.option("-i", "--include", default="", help="use only these hosts, e.g. 'host1@host2'")
@click.option("-e", "--exclude", default="", help="leave these hosts out, e.g. 'host3'")
@click.option("--ssh_port", type=int, default=None, help="SSH port for every host (else the ssh config's)")
@click.option("--launcher_args", default="", help="ssh options: -F FILE, -i KEY, -l USER, -p PORT, -o Key=Value")
@click.option("--ssh_accept_new_host_keys", is_flag=True, help="accept and record keys of hosts not in known_hosts")
@click.argument("words", nargs=-1, required=True, type=click.UNPROCESSED, metavar="COMMAND...")
def command(hostfile: str, include: str, exclude: str, ssh_port: int | None, launcher_args: str,
            ssh_accept_new_host_keys: bool, words: tuple[str, ...]) -> int:
    """Run COMMAND (shell text, as pdsh takes it) on every host of the hostfile at once."""
    from dslaunch.launcher.agent.output import Sink
    from dslaunch.launcher.runners.ssh.connect import SSHOptions, load_config, resolve
    from dslaunch.launcher.runners.ssh.every_host import run_on_hosts

    hosts = [h for h, slots in apply_filter(read_hostfile(hostfile, explicit=True), include, exclude).items() if slots]
    options = SSHOptions.from_launcher_args(launcher_args, port=ssh_port, accept_new_host_keys=ssh_accept_new_host_keys)
    config = load_config(options.config_file)
    targets = [resolve(h, options, config) for h in hosts]
    sys.stdout.flush()
    codes = run_on_hosts(targets, " ".join(words), Sink(sys.stdout.fileno()), Sink(sys.stderr.fileno()))
    failed = [f"{host} (exit {code})" for host, code in codes.items() if code != 0]
    if failed:
        click.echo(shorten(f"dslaunch ssh: {len(failed)} of {len(codes)} host(s) failed: {', '.join(failed)}", 1000),
                   err=True)
    return max(codes.values())


def ds_ssh() -> int:
    """DeepSpeed's ``ds_ssh`` console script: ``dslaunch ssh`` with the same arguments."""
    from dslaunch.launcher.cli import main

    return main(["ssh", *sys.argv[1:]])
