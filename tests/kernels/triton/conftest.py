"""Run the Triton kernels through Triton's interpreter, on CPU tensors (no GPU on the test machines).

``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel module is imported, so it is set here,
before any test module imports one (``interpret.kernel_module`` checks that it took).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
