"""A fit's fast path: whether the one-pass reduction runs, its warm-up, its shifts and its notes.

:class:`~lightning_hookdiag._onepass.OnePass` reduces a large output in one compiled pass. This module wires it into a
fit (``MeasureConfig.fast_path``): it decides whether the fit uses it (``"auto"``: CUDA with Triton only, as compiling
costs 7-76 s on a CPU for milliseconds a step), warms it once the first window was pooled (the first step it can be
used on is the next sampled one: it needs each layer's last pooled mean as its shift), hands the pooled means to the
recorder, and turns what the reduction noted into the callback's one-time notes. Each compiled call is made outside
what the package itself holds while hooks are attached and the compiled function must not see: the hooks'
``force_eager`` stance, the attention probe's torch-function mode and a replay's in-place guard.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_hookdiag._hooks import compiled_stance
from lightning_hookdiag._inplace import InPlaceGuard
from lightning_hookdiag._logged_values import Note
from lightning_hookdiag._onepass import OnePass, has_compiler
from lightning_hookdiag._precursor_probes import AttentionProbe
from lightning_hookdiag._recorder import StepRecorder
from lightning_hookdiag._torch_internals import left_modes

__all__ = ["FastPath", "fast_dtypes", "uses_fast_path"]


def uses_fast_path(setting: str, device: torch.device) -> bool:
    """Whether a fit on ``device`` with ``MeasureConfig.fast_path=setting`` builds the one-pass reduction.

    ``"on"`` builds it anywhere (where it cannot compile, it says so once and takes today's path).
    """
    if setting == "on":
        return True
    return setting == "auto" and device.type == "cuda" and has_compiler(device)


def fast_dtypes(precision: str | int | None) -> tuple[torch.dtype, ...]:
    """The output dtypes warmed for a Trainer ``precision``: float32, and bfloat16 at ``bf16-*``.

    Float16 outputs (``16-mixed``) take today's path (not read by the fast path: a note says so when one is seen).
    """
    if "bf16" in str(precision):
        return (torch.float32, torch.bfloat16)
    return (torch.float32,)


def _own(mode: Any) -> bool:
    return isinstance(mode, (AttentionProbe, InPlaceGuard))


@contextlib.contextmanager
def _lifted() -> Iterator[None]:
    """Outside the hooks' ``force_eager`` stance and the package's own modes, for one compiled call."""
    with compiled_stance(), left_modes(_own):
        yield


class FastPath:
    """The fit's one-pass reduction, or nothing when it does not use one.

    Args:
        setting: ``MeasureConfig.fast_path``: ``"auto"``, ``"on"`` or ``"off"``.
        device: The module's device at the fit's start.
        precision: The Trainer's ``precision`` (the dtypes warmed, :func:`fast_dtypes`).
    """

    def __init__(self, setting: str, device: torch.device, precision: str | int | None) -> None:
        self.setting = setting
        self.onepass: OnePass | None = OnePass(lift=_lifted) if uses_fast_path(setting, device) else None
        self.dtypes = fast_dtypes(precision)
        self._warmed = False
        self._given = 0  # how many of the reduction's notes were turned into the callback's
        self._warm_note = -1  # the index of the note of the warm-up's time (an info line)
        self._seen: Counter[str] = Counter()  # the paths counted up to the last window
        self._ran = False  # the fast path's first window was said

    def pooled(self, recorder: StepRecorder, means: Tensor, counts: Sequence[float], device: torch.device) -> None:
        """A window was pooled: its ``act_mean`` (on the device) becomes each observed layer's shift; warm once."""
        if self.onepass is None:
            return
        recorder.set_shifts(means, [count > 0 for count in counts])
        if not self._warmed:
            # Its time, or why it cannot run, in its notes; under a mode it cannot compile in: again next window.
            seconds = self.onepass.warm(self.dtypes, device)
            self._warmed = seconds is not None or self.onepass.disabled is not None
            if seconds:  # compiled: its time is the note it wrote last
                self._warm_note = len(self.onepass.notes) - 1

    def notes(self) -> list[Note]:
        """The reduction's notes since the last call, as one-time notes: its warm-up time, each reason it fell back.

        The warm-up time is an info line; a fallback is a warning where ``fast_path="on"`` asked for the fast path,
        an info line under ``"auto"``.
        """
        if self.onepass is None:
            return []
        notes = self._first_window()
        new = self.onepass.notes[self._given :]
        first = self._given
        self._given = len(self.onepass.notes)
        for i, text in enumerate(new, start=first):
            timing = i == self._warm_note
            key = "fast_path:warm" if timing else f"fast_path:{text}"
            info = timing or self.setting != "on"
            notes.append(Note(key, f"LayerHealthCallback: fast path: {text.removeprefix('onepass: ')}", info=info))
        return notes

    def _first_window(self) -> list[Note]:
        """The first window with a tensor on the fast path: which path each tensor of it took, and why (once)."""
        assert self.onepass is not None
        window = self.onepass.paths - self._seen
        self._seen = Counter(self.onepass.paths)
        if self._ran or not window["fast"]:
            return []
        self._ran = True
        others = ", ".join(f"{why.removeprefix('today: ')} {n}" for why, n in sorted(window.items()) if why != "fast")
        text = f"{window['fast']} tensors reduced in one pass on this step; today's path for: {others or 'none'}"
        return [Note("fast_path:ran", f"LayerHealthCallback: fast path: {text}", info=True)]
