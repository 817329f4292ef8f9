"""validation.integer's optional: None passes only where asked for (mutation review: accepting None always survived)."""

from __future__ import annotations

import pytest

from lightning_hookdiag.validation import integer


def test_none_is_an_error_unless_optional():
    with pytest.raises(ValueError, match=r"^every_n_steps: expected an integer >= 1, got None$"):
        integer("every_n_steps", None, "an integer >= 1", lambda v: v >= 1)
    assert integer("unit_dim", None, "an integer axis or None", optional=True) is None
