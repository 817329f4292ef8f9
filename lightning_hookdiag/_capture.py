"""``capture_activations``: the hook machinery as a context manager, for use outside training."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from lightning_hookdiag._errors import LayerHealthWarning
from lightning_hookdiag._hooks import HookSet
from lightning_hookdiag._selection import resolve_layers
from lightning_hookdiag._validation import check, module_names

__all__ = ["capture_activations"]


def _detach(output: Any, to_cpu: bool) -> Any:
    if isinstance(output, Tensor):
        output = output.detach()
        return output.cpu() if to_cpu else output
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # named tuples keep their type
        return type(output)(*(_detach(o, to_cpu) for o in output))
    if isinstance(output, (tuple, list)):
        return type(output)(_detach(o, to_cpu) for o in output)
    if isinstance(output, Mapping):
        return {k: _detach(v, to_cpu) for k, v in output.items()}
    return output


@contextmanager
def capture_activations(
    model: nn.Module, layers: str | Sequence[str], to_cpu: bool = False
) -> Iterator[dict[str, Any]]:
    """Capture the outputs of named submodules while the ``with`` block runs.

    Args:
        model: Any ``nn.Module``; names are relative to it and may be globs (see
            :func:`~lightning_hookdiag.list_layers` for the valid names).
        layers: A name or a list of names or globs.
        to_cpu: Move each captured tensor to the CPU as it is captured.

    Inside the block, ``torch.compile``-d code runs eagerly (the compiler ignores hooks added after compilation);
    the compile cache is untouched, so compiled code runs again as before once the block ends.

    Yields:
        A dict filled as modules run: ``acts[name]`` is the detached output of that module's most recent call
        (tensors inside tuples, lists and dicts are detached too). A module that never ran is absent, and a
        :class:`~lightning_hookdiag.LayerHealthWarning` names it when the block ends.

    Raises:
        ValueError: If ``layers`` is not a name or a sequence of names (the callback's ``layers=`` check), if a name
            matches no module (the message lists the closest names), or if a name is a TorchScript module.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> with capture_activations(net, ["0", "1"]) as acts:
        ...     _ = net(torch.randn(3, 4))
        >>> sorted(acts), acts["1"].shape, acts["1"].requires_grad
        (['0', '1'], torch.Size([3, 8]), False)
        >>> len(net[0]._forward_hooks)
        0
    """
    # The callback's check of its layers= (None is its default selection, which a capture has no use for).
    check("layers", layers, "a module name or glob, or a sequence of them", lambda v: v is not None)
    modules = resolve_layers(model, module_names("layers", layers))
    names = list(modules)
    acts: dict[str, Any] = {}

    def store(index: int, output: Any) -> None:
        acts[names[index]] = _detach(output, to_cpu)

    with HookSet(modules, store):
        yield acts
    if missing := [n for n in names if n not in acts]:
        warnings.warn(
            f"capture_activations: {', '.join(missing)} did not run inside the block (forward called directly,"
            " or a branch not taken); nothing was captured for them",
            LayerHealthWarning,
            stacklevel=3,
        )
