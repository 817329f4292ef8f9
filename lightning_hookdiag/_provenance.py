"""Where a NaN/Inf was made between two selected layers (``docs/rules.md#nonfinite-and-functional-code``).

Only while the sentinel replays a tripped step, one global forward hook records, for every module call, on the device,
whether its positional inputs held a NaN/Inf and whether its output did; the flags are read once, at the end. Forward
hooks fire when a forward *returns*, so the first call to return a non-finite output from finite inputs is the
innermost module whose ``forward`` made it. Masks are passed by keyword (``attn_mask=``) and may hold ``-inf`` on
purpose, so only positional arguments count as inputs; for the same reason a NaN is preferred over an Inf (a module
that builds a ``-inf`` mask from finite inputs is named only when no module made a NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_hookdiag._hooks import sink_mode, tensors
from lightning_hookdiag._names import ROOT, logged_name
from lightning_hookdiag._torch_internals import in_backward

__all__ = ["NonFiniteTrace", "nonfinite_in_batch"]


def _inexact(value: Any, path: str | None = None) -> list[tuple[str | None, Tensor]]:
    return [(p, t) for p, t in tensors(value, path) if t.is_floating_point() or t.is_complex()]


def nonfinite_in_batch(batches: Sequence[Any]) -> list[tuple[str, int, int]]:
    """The floating-point tensors of a step's micro-batches that hold NaN/Inf: ``(path, bad elements, elements)``.

    Summed per path over every micro-batch, with one host read, so that data that arrives non-finite is named.

    Example:
        >>> nonfinite_in_batch([(torch.tensor([[1.0, float("nan")], [0.0, 2.0]]), torch.tensor([1, 0]))])
        [('batch[0]', 1, 4)]
        >>> nonfinite_in_batch([{"x": torch.ones(3)}])
        []
    """
    # Under the named root "batch" every tensor has a path; the test only tells the type checker so.
    found = [(path, t) for batch in batches for path, t in _inexact(batch, "batch") if path is not None]
    if not found:
        return []
    device = found[0][1].device
    counts = torch.stack([(~torch.isfinite(t.detach())).sum().to(device) for _, t in found]).tolist()  # the read
    bad: dict[str, list[int]] = {}
    for (path, t), n in zip(found, counts, strict=True):
        total = bad.setdefault(path, [0, 0])
        total[0] += int(n)
        total[1] += t.numel()
    return [(path, n, size) for path, (n, size) in bad.items() if n > 0]


def _any_nonfinite(found: Sequence[Tensor], device: torch.device) -> Tensor:
    if not found:
        return torch.zeros((), dtype=torch.bool, device=device)
    return torch.stack([~torch.isfinite(t).all().to(device) for t in found]).any()


class NonFiniteTrace:
    """Record, for every module call while attached, whether NaN/Inf went in and came out (see the module docstring).

    ``root`` is the LightningModule: module names are relative to it, as the callback logs them, the root itself is
    :data:`~lightning_hookdiag.rules.ROOT`, and modules outside it are not recorded.

    Example:
        >>> class Log(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         return torch.log(self.lin(x))
        >>> net = nn.Sequential(nn.Linear(2, 2), Log(), nn.Linear(2, 1))
        >>> for param, value in zip(net.parameters(), (1.0, 0.0, -1.0, 0.0)):  # 1.lin's outputs are all < 0
        ...     _ = param.data.fill_(value)
        >>> trace = NonFiniteTrace(net)
        >>> trace.attach()
        >>> _ = net(torch.ones(3, 2))
        >>> trace.remove()
        >>> trace.origin(["0", "1.lin", "2"])  # 2 received the NaN; it was made inside 1's forward
        ('2', '1')
    """

    def __init__(self, root: nn.Module) -> None:
        self._names = {module: logged_name(path, root) if path else ROOT for path, module in root.named_modules()}
        self._calls: list[tuple[str, Tensor]] = []
        self._handle: RemovableHandle | None = None

    def attach(self) -> None:
        """Register the global forward hook and start a new record (no-op if attached)."""
        if self._handle is None:
            self._calls = []
            self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)

    def remove(self) -> None:
        """Remove the global forward hook; safe to call any number of times."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(module)
        if name is None or in_backward():  # a recomputation inside backward saw these values already
            return
        outputs = [t for _, t in _inexact(output)]
        if not outputs:
            return
        with sink_mode():
            device, inputs = outputs[0].device, [t for _, t in _inexact(args)]
            nan = torch.stack([torch.isnan(t).any().to(device) for t in outputs]).any()
            flags = torch.stack([_any_nonfinite(inputs, device), nan, _any_nonfinite(outputs, device)])
        self._calls.append((name, flags))

    def origin(self, selected: Sequence[str]) -> tuple[str | None, str | None]:
        """Where the first NaN/Inf among the ``selected`` layers (names) came from, with one host read.

        ``(entry, origin)``: the first selected layer (in the order forwards returned) whose output was non-finite
        *if its input already was*, and the innermost module whose forward made it
        (:data:`~lightning_hookdiag.rules.ROOT` for the LightningModule's own; ``None``: made outside every forward,
        e.g. in ``training_step``). ``(None, None)`` when nothing is non-finite or the layer made it.
        """
        calls, self._calls = self._calls, []
        if not calls:
            return None, None
        device = calls[0][1].device
        flags = torch.stack([f.to(device) for _, f in calls]).tolist()  # the one read
        records = [(name, bad_in, nan, bad) for (name, _), (bad_in, nan, bad) in zip(calls, flags, strict=True)]
        wanted = set(selected)
        entry = next((r for r in records if r[3] and r[0] in wanted), None)
        if entry is None or not entry[1]:
            return None, None
        made = [r for r in records if r[3] and not r[1]]
        origin = next((r[0] for r in made if r[2]), made[0][0] if made else None)
        return entry[0], origin
