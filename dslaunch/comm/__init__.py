"""DeepSpeed's ``deepspeed.comm``: collectives and process-group queries with DeepSpeed's extra
keyword arguments and its comms logger, implemented in ``dslaunch.runtime.comm.comm``.

Every name of that module's ``__all__`` is this module's (the same objects: ``comms_logger`` is the
one logger of the process).
"""

from dslaunch.runtime.comm import comm as _comm

__all__ = list(_comm.__all__)
globals().update({name: getattr(_comm, name) for name in __all__})
