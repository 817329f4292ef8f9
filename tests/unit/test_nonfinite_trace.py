"""``NonFiniteTrace`` on its own: which module made a NaN, read from one forward under its global hook.

Through a real Trainer (a NaN named at the module that made it, on a replayed step) it is
``tests/integration/test_provenance.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hookdiag._provenance import NonFiniteTrace


def test_the_trace_prefers_a_nan_and_ignores_keyword_masks():
    class Mask(nn.Module):  # builds a -inf mask from finite inputs, on purpose
        def forward(self, x):
            return torch.full_like(x, float("-inf")).triu(1)

    class Attend(nn.Module):
        def forward(self, x, mask=None):
            return x + mask.nan_to_num(neginf=0.0)

    class Sqrt(nn.Module):
        def forward(self, x):
            return torch.sqrt(x - 10.0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.mask, self.attend, self.sqrt, self.head = Mask(), Attend(), Sqrt(), nn.Linear(3, 3)

        def forward(self, x):
            return self.head(self.sqrt(self.attend(x, mask=self.mask(x))))

    model = Model()
    trace = NonFiniteTrace(model)
    trace.attach()
    model(torch.ones(3, 3))
    trace.remove()
    # attend got a -inf mask by keyword: its input counts as finite; mask's -inf is not the NaN sqrt made.
    assert trace.origin(["attend", "head"]) == ("head", "sqrt")
    assert trace.origin(["head"]) == (None, None)  # one read: the record is consumed


def test_the_trace_formats_no_path_for_a_module_call():
    class Key(str):
        formatted = 0

        def __repr__(self) -> str:
            Key.formatted += 1
            return super().__repr__()

    class Named(nn.Module):
        def forward(self, x):
            return {Key("y"): x * float("nan")}

    model = nn.Sequential(Named())
    trace = NonFiniteTrace(model)
    trace.attach()
    try:
        model(torch.ones(2))
    finally:
        trace.remove()
    assert trace.origin(["0"]) == (None, None)  # the layer made it itself
    assert Key.formatted == 0  # the replay's hook runs on every module call: it builds no throw-away strings
