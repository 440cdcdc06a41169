"""The Ray runner (``--launcher ray``): one node agent per Ray node, each started by an actor pinned
to its node (``cluster.py``: which nodes and slots; ``actor.py``: what runs on the node;
``nodes.py``: the job's placement group and actors, kept across runs; ``runner.py``: the
controller's side). Ray is optional: ``pip install 'dslaunch[ray]'``."""
