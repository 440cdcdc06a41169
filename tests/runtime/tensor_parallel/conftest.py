"""The Hugging Face test runs its jobs in ``.venv-compat`` (transformers), as tests/compat do."""

from tests.compat.conftest import compat_bin  # noqa: F401 (the fixture, shared)
