"""The SSH transport: runs one node agent per host over paramiko.

Owns logging in (``options``: ssh config and the user's SSH flags; ``connect``: keys, known_hosts,
parallel connects, ``SSHError``), one remote command per host (``session``), the launch-time
checks on each host's probe answer (``preflight``) and the runner itself (``runner``).
``sshlib`` imports paramiko without its slow ``invoke`` dependency.

Nothing is imported here: ``runners.RUNNERS`` names ``runner:SSHRunner`` so that only an SSH
launch pays for paramiko.
"""
