"""Communication: the collectives every part of the runtime calls (``comm.py``: DeepSpeed's
``deepspeed.comm``, which ``dslaunch.comm`` re-exports), the comms logger's records and table
(``comms_logging.py``), and DeepSpeed's ``deepspeed.runtime.comm`` path: collectives over several
tensors at once (``coalesced_collectives.py``)."""
