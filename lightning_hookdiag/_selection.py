"""A user's layer configuration as an ordered ``{name: module}`` mapping, under the logged names (``names.py``).

How a user chooses layers: ``README.md#choosing-layers``.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import sys
import warnings
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.utils import parametrize

from lightning_hookdiag._errors import LayerHealthWarning
from lightning_hookdiag._names import logged_name
from lightning_hookdiag._torch_internals import LOSS_BASE
from lightning_hookdiag._validation import check

__all__ = [
    "LayerInfo",
    "excluded_names",
    "import_types",
    "is_default_layer",
    "is_measurement",
    "list_layers",
    "named_modules",
    "resolve_layers",
    "unmatched_error",
]

# Containers without a ``forward``: they can never produce an output to observe.
_NOT_CALLABLE = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class LayerInfo(NamedTuple):
    """One selectable module, as returned by :func:`list_layers`."""

    name: str
    type: str
    leaf: bool

    def __str__(self) -> str:
        return f"{self.name}  ({self.type}{', leaf' if self.leaf else ''})"


def named_modules(root: nn.Module) -> dict[str, nn.Module]:
    """Every submodule of ``root`` (not the root itself) under its logged name, in ``named_modules()`` order.

    A wrapper and the module it wraps share a name; the wrapped module, which ``named_modules()`` yields after its
    wrapper, wins, because it is the one whose ``forward`` does the work.
    """
    return {name: module for path, module in root.named_modules() if (name := logged_name(path, root))}


def _is_leaf(module: nn.Module) -> bool:
    return not any(True for _ in module.children()) and not isinstance(module, _NOT_CALLABLE)


def is_measurement(module: nn.Module) -> bool:
    """Whether ``module`` measures the network rather than being part of it: a loss or a torchmetrics ``Metric``.

    Both are leaf modules called in ``training_step`` whose outputs are a number computed without gradient:
    observing them logs statistics of a number and warns about a gradient that is absent by design.
    """
    if isinstance(module, LOSS_BASE):
        return True
    # If torchmetrics is not imported yet, no module can be one of its metrics; importing it would cost seconds.
    metric = getattr(sys.modules.get("torchmetrics"), "Metric", None)
    return isinstance(metric, type) and isinstance(module, metric)


def is_default_layer(module: nn.Module) -> bool:
    """Whether ``layers=None`` selects ``module``: a leaf, or a module that computes with parameters it owns.

    The second kind owns parameters directly and has only leaf children, such as ``nn.MultiheadAttention``: it uses
    its ``out_proj`` child's weight functionally, so only the module itself can be observed. A model that owns
    parameters next to whole sub-networks (a ViT's ``cls_token``) is not selected: its output is the network's,
    already observed at the head. Never a measurement (:func:`is_measurement`); a module's ``parametrizations``
    (``torch.nn.utils.parametrize``) compute its weight, so it is judged without them.
    """
    if isinstance(module, _NOT_CALLABLE) or is_measurement(module):
        return False
    parametrized = parametrize.is_parametrized(module)
    children = [c for c in module.children() if not (parametrized and c is module.parametrizations)]
    owns = parametrized or any(True for _ in module.parameters(recurse=False))
    return not children or (owns and all(_is_leaf(c) for c in children))


def list_layers(model: nn.Module) -> list[LayerInfo]:
    """List the names that ``layers=`` and ``capture_activations`` accept, with their types.

    Args:
        model: The module to inspect (a ``LightningModule`` or any ``nn.Module``).

    Returns:
        One :class:`LayerInfo` per submodule, in registration order. ``leaf`` marks modules without children;
        ``layers=None`` selects the modules of :func:`is_default_layer` (losses and metrics only by name).

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        >>> for info in list_layers(net):
        ...     print(info)
        0  (Linear, leaf)
        1  (ReLU, leaf)
    """
    return [LayerInfo(name, type(m).__name__, _is_leaf(m)) for name, m in named_modules(model).items()]


def import_types(types: Iterable[type[nn.Module] | str] | None, argument: str) -> tuple[type[nn.Module], ...]:
    """Resolve classes given as objects or import strings such as ``"torch.nn.Linear"``.

    A string that cannot be imported, or a value that is no ``nn.Module`` subclass, raises a ``ValueError`` naming the
    configuration ``argument``.
    """
    if types is None:
        return ()
    if isinstance(types, (str, type)):
        types = [types]
    if not isinstance(types, Iterable):
        raise ValueError(
            f"{argument}: expected an nn.Module subclass, an import string or a sequence of them, got {types!r}"
        )
    resolved: list[type[nn.Module]] = []
    for item in types:
        cls: object = item
        if isinstance(item, str):
            module_name, _, attr = item.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_name), attr) if module_name else None
            except (ImportError, AttributeError):
                cls = None
            if cls is None:
                raise ValueError(
                    f"{argument}: cannot import {item!r}; expected a full import path of an nn.Module subclass,"
                    " such as 'torch.nn.Linear'"
                )
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ValueError(f"{argument}: expected nn.Module subclasses or import strings, got {item!r}")
        resolved.append(cls)
    return tuple(resolved)


def unmatched_error(pattern: str, argument: str, names: Sequence[str]) -> ValueError:
    """The error for a module name or glob that matches none of ``names``, with the closest names."""
    # A parameter or a too-deep path ("encoder.0.weight") is best answered with the deepest module above it.
    parents = [n for n in names if pattern.startswith(n + ".")][-1:]
    close = list(dict.fromkeys(difflib.get_close_matches(pattern, names, n=5, cutoff=0.6) + parents))[:5]
    hint = f" Closest names: {', '.join(close)}." if close else ""
    return ValueError(
        f"{argument}: {pattern!r} matches no module.{hint} "
        "Call lightning_hookdiag.list_layers(model) to see every selectable name."
    )


def _match(patterns: Iterable[str], names: Sequence[str], argument: str) -> set[str]:
    matched: set[str] = set()
    for pattern in patterns:
        is_glob = any(ch in pattern for ch in "*?[")
        hits = fnmatch.filter(names, pattern) if is_glob else [n for n in names if n == pattern]
        if not hits:
            raise unmatched_error(pattern, argument, names)
        matched.update(hits)
    return matched


def excluded_names(model: nn.Module, exclude: Sequence[str]) -> set[str]:
    """The logged names of the modules of ``model`` that the ``exclude`` globs remove (raising as in resolve_layers)."""
    return _match(exclude, list(named_modules(model)), "exclude") if exclude else set()


def resolve_layers(
    model: nn.Module,
    layers: Sequence[str] | None = None,
    layer_types: Sequence[type[nn.Module]] = (),
    exclude: Sequence[str] = (),
) -> dict[str, nn.Module]:
    """Select modules of ``model`` by name, glob and type: ``{logged name: module}``, in registration order.

    TorchScript modules refuse forward hooks: globs, types and the default selection leave them out with one
    :class:`~lightning_hookdiag.LayerHealthWarning`. A default selection may be empty (a module holding only parameters
    of its own, such as a matrix factorisation), with one warning.

    Args:
        model: The root module; names are relative to it.
        layers: Dotted names or fnmatch globs (``*`` also crosses dots). ``None`` selects every module of
            :func:`is_default_layer` but nothing inside a measurement, or, with ``layer_types``, every module.
        layer_types: Keep only instances of these classes.
        exclude: Globs removed from the selection.

    Raises:
        ValueError: If ``layers`` is empty, if a name, glob or exclude pattern matches nothing, if a name is a
            TorchScript module, or if ``layers``, ``layer_types`` or ``exclude`` leave the selection empty.
    """
    modules = named_modules(model)
    names = list(modules)
    if layers is not None:
        check("layers", layers, "at least one module name or glob (None: the default selection)", bool)
        chosen = _match(layers, names, "layers")
        candidates = [n for n in names if n in chosen]
    elif layer_types:
        candidates = names
    else:
        inside = [f"{n}." for n in names if is_measurement(modules[n])]
        inside += [f"{n}.parametrizations." for n in names if parametrize.is_parametrized(modules[n])]
        candidates = [n for n in names if is_default_layer(modules[n]) and not any(n.startswith(m) for m in inside)]
    candidates = _without_scripts(candidates, modules, layers or ())
    if layer_types:
        typed = [n for n in candidates if isinstance(modules[n], tuple(layer_types))]
        if not typed:
            present = sorted({type(modules[n]).__name__ for n in candidates})
            wanted = ", ".join(t.__name__ for t in layer_types)
            raise ValueError(
                f"layer_types: no selected module is an instance of {wanted}; the selection holds {', '.join(present)}"
            )
        candidates = typed
    removed = _match(exclude, names, "exclude")
    candidates = [n for n in candidates if n not in removed]
    if not candidates and (layers is not None or layer_types or exclude):
        raise ValueError(
            f"no module left to observe after exclude={list(exclude)!r}; relax `exclude` or widen `layers`"
        )
    if not candidates:
        message = f"{type(model).__name__} has no layer to hook (no submodule to observe): only parameters are measured"
        warnings.warn(message, LayerHealthWarning, stacklevel=2)
    return {n: modules[n] for n in candidates}


def _without_scripts(candidates: list[str], modules: dict[str, nn.Module], named: Iterable[str]) -> list[str]:
    # ScriptModules raise on register_forward_hook: one warning names the outermost (what the user scripted). A module
    # named in layers= (not by a glob) is an error: the user asked for that very module.
    scripted = [n for n in modules if isinstance(modules[n], torch.jit.ScriptModule)]
    skipped = set(candidates).intersection(scripted)
    named_scripts = sorted(skipped.intersection(named))
    if named_scripts:
        raise ValueError(
            f"layers: {named_scripts[0]!r} is a TorchScript module, which refuses forward hooks; leave it out of"
            " `layers`, or name the module before torch.jit.script is applied to it"
        )
    if skipped:
        outermost = [n for n in scripted if not any(n.startswith(f"{m}.") for m in scripted)]
        inside = [m for m in outermost if any(f"{s}.".startswith(f"{m}.") for s in skipped)]
        message = f"TorchScript modules are not observed (ScriptModules refuse forward hooks): {', '.join(inside)}"
        warnings.warn(message, LayerHealthWarning, stacklevel=3)
    return [n for n in candidates if n not in skipped]
