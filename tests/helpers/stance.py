"""torch.compile's global stance, read by tests that check the callback puts it back."""

from __future__ import annotations

import torch


def compiles() -> bool:
    """Whether a fresh ``torch.compile``-d function reaches its backend (it does not under ``force_eager``)."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(1)
        return gm.forward

    torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(3))
    return bool(calls)


def current_stance() -> str:
    return torch._dynamo.eval_frame._stance.stance  # test-only peek at the global stance
