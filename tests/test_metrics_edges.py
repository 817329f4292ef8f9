"""metrics.layer_notes: only a module *inside* one that ran is covered (mutation review: ``startswith(r)`` survived)."""

from __future__ import annotations

from lightning_hookdiag.metrics import StepFacts, layer_notes


def test_a_sibling_whose_name_extends_one_that_ran_is_not_covered():
    notes = layer_notes(2, ["fc1", "fc10", "fc1.drop"], [4.0, 0.0, 0.0], StepFacts())
    assert [(n.key, n.info) for n in notes] == [("not_run:fc10", False), ("not_run:fc1.drop", True)]
