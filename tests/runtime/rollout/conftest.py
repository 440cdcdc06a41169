"""The rollout tests on a Hugging Face model run in the compat venv (``make compat-venv``)."""

from tests.compat.conftest import compat_bin  # noqa: F401 (the fixture, shared)
