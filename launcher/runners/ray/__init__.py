"""The Ray runner (``--launcher ray``): one node agent per Ray node, each started by an actor pinned
to its node (``cluster``: which nodes and slots; ``actor``: what runs on the node; ``runner``: the
controller's side). Ray is optional: ``pip install 'dslaunch[ray]'``."""
