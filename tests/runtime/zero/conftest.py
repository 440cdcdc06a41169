"""The plain-torch reference losses every stage is checked against (computed once per session)."""

from __future__ import annotations

import pytest

from tests.runtime.zero.equivalence import reference_losses


@pytest.fixture(scope="session")
def reference() -> list[float]:
    losses = reference_losses()
    assert losses[-1] < losses[0]  # it actually trains
    return losses
