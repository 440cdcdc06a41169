"""The SSH transport: runs one node agent per host over paramiko.

Owns logging in (``options.py``: ssh config and the user's SSH flags; ``connect.py``: keys,
known_hosts, parallel connects, ``SSHError``), the rendezvous address every host can reach
(``master.py``), one remote command per host (``session.py``), the launch-time checks on each
host's probe answer (``preflight.py``) and the runner itself (``runner.py``); also a shell command on
every host at once (``every_host.py``, ``dslaunch ssh``). ``sshlib.py`` imports paramiko without its
slow ``invoke`` dependency.

Nothing is imported here: ``runners.RUNNERS`` names ``runner:SSHRunner`` so that only an SSH
launch pays for paramiko.
"""
