"""The one-pass fast path for one tensor's statistics: a row (and an output's per-unit maxima) from one compiled pass.

:func:`~lightning_hookdiag._stats.reduce_tensor` reduces an output in 10 tensor ops per piece of
:data:`~lightning_hookdiag._stats.CHUNK_ELEMENTS`, plus 2 for the per-unit maxima. :class:`OnePass` writes the same
row (:func:`~lightning_hookdiag._stats.activation_row`, one row for the whole tensor) and the same per-unit maxima from
one ``torch.compile``'d function that reads the tensor once: one generated loop (inductor) that keeps every
accumulator in registers, so nothing is allocated in proportion to the tensor. Per-unit maxima come from the same
loop: the tensor is viewed as ``[before, units, after]`` and every statistic is reduced over the outer axes into
per-unit partials, which a second, unit-sized reduction adds up.

A gradient's row (:func:`~lightning_hookdiag._stats.gradient_row`) comes from one compiled pass too, off the CPU: there
each of today's 8 ops per piece is a kernel launch. On the CPU gradients stay on today's path, whose sum of squares is
a BLAS ``dot``: the compiled pass was measured slower there (1.04-1.44x for float32, 1.47-1.69x for bf16), see
``benchmarks/README.md``.

**The numeric contract** (``docs/statistics.md#the-numeric-contract``): inductor's float64 sums accumulate
sequentially per vector lane, not in cascade as torch's own sums do, so a plain sum of squares of values of mean
``10**4`` times their spread loses the variance (measured in the issue's prototype). The sums are therefore taken of
``x - shift`` in float64, with ``shift`` the caller's estimate of the mean (the layer's last pooled ``act_mean``, never
the first element, which may be 0), and un-shifted in float64 into the row's plain sums: the un-shifting rounds at
~1e-16 of ``n * shift**2``, as today's float64 sum of squares does. A shift far from the mean (a layer whose mean
moved by many spreads since it was last pooled) brings the error back, as ``((mean - shift) / std) ** 2``.

**It never makes a run worse.** It runs only after :meth:`OnePass.warm` compiled it, for the dtypes and shapes warmed,
with a shift, on tensors of at least :data:`FAST_MIN_ELEMENTS`; anything else takes today's path. No C++ compiler, a
failed compile, the recompile limit, an active ``TorchDispatchMode`` or ``TorchFunctionMode``, an unsupported dtype,
or a compiled function
that would run eagerly (``torch.compiler.set_stance("force_eager")``, dynamo disabled) takes today's path too, with
one note per reason in :attr:`OnePass.notes` for the caller to log. The compiled function's eager body is never run:
its first statement raises when it is not being compiled.

The callback builds one per fit where ``MeasureConfig.fast_path`` says so (:mod:`lightning_hookdiag._fast_path`), and
the recorder calls it in place of :func:`~lightning_hookdiag._stats.reduce_tensor`.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lightning_hookdiag import _stats as stats
from lightning_hookdiag._stats import Workspace
from lightning_hookdiag._torch_internals import function_modes, in_dispatch_mode, recompile_limit_error

__all__ = ["FAST_DTYPES", "FAST_MIN_ELEMENTS", "OnePass", "Reserve", "has_compiler", "has_cxx_compiler"]

Reserve = Callable[[list[int]], Tensor]
"""The caller's rows: given the element counts of the pieces a tensor is reduced in, one row per piece to write."""

FAST_MIN_ELEMENTS = (1 << 16) + 1
"""Tensors below this many elements stay on today's path: the recorder stacks those of up to 64 K elements.

A compiled call has a fixed cost of ~20-40 µs (guards, the wrapper, the row copy). On the CPU an output of 64 K
elements costs the same on both paths, from 128 K on the compiled one is faster (``benchmarks/onepass.py``); on an
accelerator every op of today's path is a kernel launch, so everything the stacks do not take is one pass.
"""

FAST_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the compiled reduction reads, those measured and tested; others (fp16, float64, float8, ...) take today's
path with a note."""


class _RanEagerly(RuntimeError):
    """The compiled function was about to run its own (slow, op-by-op) body instead of the compiled one."""


def _require_compiled() -> None:
    # Under dynamo this is a constant False branch, traced away; run eagerly, it stops the call before any tensor op.
    if not torch.compiler.is_compiling():
        raise _RanEagerly("the compiled reduction would run eagerly")


def _act_parts(x: Tensor, shift: Tensor, dims: list[int]) -> tuple[Tensor, ...]:
    """Per-slice ``[nonzero, nonzero_finite, shifted sum, shifted sum of squares, min, max]`` over ``dims``."""
    finite = torch.isfinite(x)
    nonzero = x != 0  # NaN and Inf are non-zero, -0.0 is zero (as activation_row counts)
    narrow = torch.where(finite, x, 0)
    centred = torch.where(finite, x.to(torch.float64) - shift, 0.0)
    return (
        nonzero.sum(dims),
        (nonzero & finite).sum(dims),
        centred.sum(dims),
        (centred * centred).sum(dims),
        narrow.amin(dims),
        narrow.amax(dims),
    )


def _act_row(parts: tuple[Tensor, ...], numel: int, shift: Tensor) -> Tensor:
    """Un-shift whole-tensor parts into :func:`~lightning_hookdiag._stats.activation_row`'s row (float64, on device)."""
    nonzero, nonzero_finite, s1, s2, low, high = parts
    finite_count = (numel - (nonzero - nonzero_finite)).to(torch.float64)
    total = s1 + finite_count * shift
    squares = s2 + 2 * shift * s1 + finite_count * shift * shift
    wide = [nonzero.to(torch.float64), nonzero_finite.to(torch.float64), total, squares]
    return torch.stack([*wide, low.to(torch.float64), high.to(torch.float64)])


def _safe_shift(shift: Tensor) -> Tensor:
    """The ``[1]`` shift as a 0-d tensor, a NaN/Inf pooled mean read as 0 (it would poison every sum).

    Read as 0, the accuracy is that of no shift, never a wrong NaN. A ``[1]`` tensor, not a 0-d one: dynamo reads a
    0-d CPU tensor as a scalar, guarded by ``not isnan(shift.item())`` (a host read on every call, and a recompile
    for a NaN mean).
    """
    shift = shift.reshape(())
    return torch.where(torch.isfinite(shift), shift, 0.0)


def _widen(x: Tensor) -> Tensor:
    # bf16 read as float32 in registers (exact): inductor's per-unit pass over bf16 itself was 5-8x slower.
    return x.float() if x.dtype == torch.bfloat16 else x


def _act_flat(x: Tensor, shift: Tensor) -> Tensor:
    """One output, flat: the ``[ACT_ROW]`` float64 row."""
    _require_compiled()
    shift = _safe_shift(shift)
    return _act_row(_act_parts(_widen(x), shift, [0]), x.shape[0], shift)


def _act_units(x: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """One output viewed ``[before, units, after]``: the row and the per-unit maxima, from one read of ``x``."""
    _require_compiled()
    shift = _safe_shift(shift)
    wide = _widen(x)
    nonzero, nonzero_finite, s1, s2, low, high = _act_parts(wide, shift, [0, 2])  # per-unit partials
    parts = (nonzero.sum(), nonzero_finite.sum(), s1.sum(), s2.sum(), low.amin(), high.amax())
    units = wide.amax([0, 2])  # NaN propagates, and becomes +inf below (stats.unit_maxima)
    maxima = torch.nan_to_num(units, nan=math.inf, posinf=math.inf, neginf=-math.inf).to(x.dtype)
    return _act_row(parts, x.shape[0] * x.shape[1] * x.shape[2], shift), maxima


def _grad_flat(g: Tensor, shift: Tensor) -> Tensor:
    """One gradient, flat: the ``[GRAD_ROW]`` float64 row; ``shift`` is unused (squares of a gradient do not cancel)."""
    _require_compiled()
    del shift  # one signature for every body: the caller passes the same arguments
    nonzero = g != 0  # NaN and Inf are non-zero, -0.0 is zero (as gradient_row counts)
    finite = torch.isfinite(g)
    wide = torch.where(finite, _widen(g).to(torch.float64), 0.0)
    return torch.stack(
        [nonzero.sum().to(torch.float64), (nonzero & finite).sum().to(torch.float64), (wide * wide).sum()]
    )


_BODIES: dict[str, Callable[..., Any]] = {"act": _act_flat, "units": _act_units, "grad": _grad_flat}


def has_cxx_compiler() -> bool:
    """Whether inductor finds a C++ compiler for CPU kernels (``$CXX``, else ``g++``, ``c++`` or ``clang++``)."""
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    return any(shutil.which(c) for c in candidates if c)


def has_compiler(device: torch.device) -> bool:
    """Whether inductor can generate kernels for ``device``: a C++ compiler on the CPU, Triton on CUDA (and XPU)."""
    if device.type == "cpu":
        return has_cxx_compiler()
    if device.type in ("cuda", "xpu"):
        return importlib.util.find_spec("triton") is not None
    return False  # MPS and others: not measured here


def _unit_view(x: Tensor, unit_dim: int | None) -> Tensor:
    """``x`` viewed ``[before, units, after]`` around its unit axis (:func:`~lightning_hookdiag._stats.unit_maxima`)."""
    dim = unit_dim % x.ndim if unit_dim is not None else 1 if x.ndim >= 4 else x.ndim - 1
    before = math.prod(x.shape[:dim])
    after = math.prod(x.shape[dim + 1 :])
    return x.view(before, x.shape[dim], after)


def _variant(view: Tensor) -> tuple[bool, ...]:
    # Dynamo specialises sizes 0 and 1 of a dynamic dimension: each such pattern is a graph of its own.
    return tuple(size == 1 for size in view.shape)


class OnePass:
    """The one-pass reduction of an output or a gradient, with today's path as the fallback for everything else.

    Args:
        has_compiler: Whether a C++ compiler is available for CPU kernels; ``None``: look for one
            (:func:`has_cxx_compiler`). ``False`` sends every CPU tensor to today's path with one note.
        backend: The ``torch.compile`` backend (``"inductor"``; a backend callable is passed through as is).
        min_elements: Tensors with fewer elements take today's path (:data:`FAST_MIN_ELEMENTS`).
        gradients: Gradients on the fast path too; ``None``: off the CPU only, where each of today's 8 ops per piece
            is a kernel launch (on the CPU the compiled pass was measured 1.04-1.44x today's time for float32,
            1.47-1.69x for bf16: today's sum of squares is a BLAS ``dot``).
        lift: A context entered around each fast-path candidate's mode checks and compiled call: the caller's way to
            leave what it holds itself and the compiled call must not see (the hooks' ``force_eager`` stance, the
            package's own torch-function and dispatch modes). ``None``: nothing is left.

    Example:
        >>> fast = OnePass(has_compiler=False)
        >>> fast.warm() is None, fast.notes
        (True, ['onepass: no C++ compiler found for CPU kernels: every tensor takes the per-piece path'])
    """

    def __init__(
        self,
        has_compiler: bool | None = None,
        backend: str | Callable[..., Any] = "inductor",
        min_elements: int = FAST_MIN_ELEMENTS,
        lift: Callable[[], AbstractContextManager[Any]] | None = None,
        gradients: bool | None = None,
    ) -> None:
        if not isinstance(min_elements, int) or min_elements < 2:
            raise ValueError(f"min_elements: expected an int >= 2, got {min_elements!r}")
        self._has_compiler = has_compiler
        self.min_elements = min_elements
        self._lift = lift if lift is not None else contextlib.nullcontext
        self._gradients = gradients
        self._zeros: dict[torch.device, Tensor] = {}  # a gradient's (unused) shift, made on each device once
        self._compiled = {
            kind: torch.compile(body, fullgraph=True, dynamic=True, backend=backend) for kind, body in _BODIES.items()
        }
        self._warmed: set[tuple[Any, ...]] = set()
        self._disabled: str | None = None
        self._failure = ""  # why the last compiled call fell back
        self._noted: set[str] = set()
        self.notes: list[str] = []
        """One line per reason the fast path was not taken (or its warm-up time), each once: for the caller's log."""
        self.paths: collections.Counter[str] = collections.Counter()
        """How many tensors took each path: ``"fast"`` or ``"today: <why>"``."""
        self.warm_seconds: float | None = None
        """Seconds :meth:`warm` spent compiling (``None`` before it ran or when it could not)."""

    def _note(self, key: str, text: str) -> None:
        if key not in self._noted:
            self._noted.add(key)
            self.notes.append(f"onepass: {text}")

    def _compiler_missing(self, device: torch.device) -> bool:
        available = has_compiler(device) if self._has_compiler is None else self._has_compiler
        return not available

    def warm(
        self, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16), device: torch.device | str = "cpu"
    ) -> float | None:
        """Compile every reduction for ``dtypes`` on ``device`` before the first sampled step; its seconds, once.

        Compiles the flat output reduction and the per-unit one for the two common unit layouts (units last:
        ``[batch, units]``; units between: ``[batch, channels, pixels]``). Returns the seconds spent
        (and notes them once), ``None`` when the fast path is off (no compiler, a failed compile: noted) or cannot be
        compiled now (an active mode that is not the caller's ``lift`` to leave: noted; warm again later), ``0.0``
        when everything asked for was already warm.
        """
        device = torch.device(device)
        unsupported = [d for d in dtypes if d not in FAST_DTYPES]
        if unsupported:
            raise ValueError(f"dtypes: {unsupported} are not read by the fast path; expected some of {FAST_DTYPES}")
        if self._compiler_missing(device):
            self._disable("no_compiler", _NO_COMPILER[device.type == "cpu"])
        if self._disabled is not None:
            return None
        with self._lift():
            if self._why_not_now() is not None:
                return None
            return self._compile(dtypes, device)

    @property
    def disabled(self) -> str | None:
        """Why the fast path is off for good (``"no_compiler"``, ``"compile_failed"``, ``"recompile_limit"``)."""
        return self._disabled

    def _compile(self, dtypes: Sequence[torch.dtype], device: torch.device) -> float | None:
        start = time.perf_counter()
        compiled = 0
        for dtype in dtypes:
            # Sizes of the tensors the fast path reads: inductor picks its loop order from the example's sizes (a
            # [7, 6, 1] example made the per-unit pass over bf16 3x slower than today's at 4 M elements), and
            # distinct ones, as dynamo gives equal sizes one symbol and the graph would hold for equal ones only.
            examples = [
                ("act", torch.ones(self.min_elements, dtype=dtype, device=device)),
                ("grad", torch.ones(self.min_elements, dtype=dtype, device=device)),
                ("units", torch.ones(1021, 256, 1, dtype=dtype, device=device)),
                ("units", torch.ones(16, 64, 257, dtype=dtype, device=device)),
            ]
            for kind, example in examples:
                key = self._key(kind, example)
                if key in self._warmed or (kind == "grad" and not self._reads_gradients(device)):
                    continue
                if self._call(kind, example, self._host_shift(0.0, device)) is None:
                    return None
                self._warmed.add(key)
                compiled += 1
        if not compiled:
            return 0.0
        seconds = time.perf_counter() - start
        self.warm_seconds = (self.warm_seconds or 0.0) + seconds
        self._note(f"warm:{sorted(map(str, dtypes))}", f"compiled {compiled} reductions in {seconds:.1f} s")
        return seconds

    def _disable(self, reason: str, text: str) -> None:
        self._failure = reason
        if self._disabled is None:
            self._disabled = reason
        self._note(reason, text)

    @staticmethod
    def _key(kind: str, view: Tensor) -> tuple[Any, ...]:
        return (kind, view.dtype, view.device.type, _variant(view) if kind == "units" else ())

    def _call(self, kind: str, view: Tensor, shift: Tensor) -> Any:
        """Run the compiled reduction; ``None`` (with a note) when it failed or would have run eagerly."""
        compiled = self._compiled[kind]
        try:
            with torch.no_grad():
                return compiled(view, shift)
        except _RanEagerly:
            self._failure = "eager"
            self._note(
                "eager",
                "the compiled reduction would run eagerly (torch.compiler.set_stance('force_eager') or dynamo"
                " disabled): today's path instead",
            )
        except recompile_limit_error():
            self._disable("recompile_limit", "torch._dynamo's recompile limit was reached: today's path from now on")
        except Exception as error:  # a compile failure of any kind: the run goes on, on today's path
            self._disable("compile_failed", f"compiling the reduction failed ({type(error).__name__}: {error})"[:300])
        return None

    def _why_not(self, x: Tensor, grad: bool, shift: float | Tensor | None) -> str | None:
        """Why ``x`` takes today's path (with its note where it is not a routine choice), ``None`` for a candidate.

        Everything but the active modes, which :meth:`_why_not_now` reads inside the caller's ``lift``.
        """
        if grad and not self._reads_gradients(x.device):
            return "gradient"  # the CPU's: today's 8 ops, ending in a BLAS dot, were faster (see gradients=)
        if self._disabled is not None:
            return self._disabled
        if x.numel() < self.min_elements:
            return "small"
        if shift is None and not grad:  # a gradient's sum of squares needs no shift
            return "no_shift"
        if x.dtype not in FAST_DTYPES:
            self._note(f"dtype:{x.dtype}", f"{x.dtype} is not read by the fast path: today's path for it")
            return "dtype"
        if not x.is_contiguous():
            return "not_contiguous"
        if torch.compiler.is_compiling():
            return "inside_compile"
        return None

    def _reads_gradients(self, device: torch.device) -> bool:
        return device.type != "cpu" if self._gradients is None else self._gradients

    def _why_not_now(self) -> str | None:
        """Why the compiled call cannot run under the modes active now (noted), ``None`` when it can."""
        if in_dispatch_mode():
            self._note("dispatch_mode", "a TorchDispatchMode is active: today's path while it is")
            return "dispatch_mode"
        if function_modes():  # dynamo guards on the mode stack: the call would compile again, mid-step (3 s)
            self._note("function_mode", "a TorchFunctionMode is active: today's path while it is")
            return "function_mode"
        return None

    def reduce_tensor(
        self,
        x: Tensor,
        reserve: Reserve | None,
        workspace: Workspace,
        grad: bool = False,
        units: bool = False,
        unit_dim: int | None = None,
        edges: Tensor | None = None,
        shift: float | Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None]:
        """:func:`~lightning_hookdiag._stats.reduce_tensor`'s inputs and outputs, on the fast path where it applies.

        The rows come from ``reserve``, asked once with the element counts of the pieces: one piece of ``x.numel()``
        on the fast path, :func:`~lightning_hookdiag._stats.piece_sizes` on today's (the pooled moments are the same).
        Histogram counts (``edges``) stay on today's code, as a pass of their own.

        Args:
            x: The output or output gradient.
            reserve: The caller's rows for pieces of these counts; ``None``: no rows.
            workspace: Today's path's scratch buffers.
            grad: ``x`` is a gradient.
            units: Also return the per-unit maxima along ``unit_dim``.
            unit_dim: The axis of the units (``None``: the default for ``x``'s rank).
            edges: The histogram's inner bin edges; ``None``: no histogram.
            shift: The layer's last pooled mean (a float or a 0-d tensor, read on the device), which the output's
                sums are taken around; ``None`` (nothing pooled yet) takes today's path. Gradients ignore it.
        """
        # Nothing for one pass to write: no rows (a stacked tensor, or one only counted) and no per-unit maxima.
        why = "stacked" if reserve is None and not units else self._why_not(x, grad, shift)
        maxima = None
        if why is None:
            view, kind = self._view(x, units, unit_dim), self._kind(grad, units)
            if self._key(kind, view) not in self._warmed:
                why = "not_warmed"
            else:
                with self._lift():
                    why = self._why_not_now()
                    if why is None:
                        done, maxima = self._fast(view, reserve, kind, shift)
                        why = None if done else self._failure
        if why is not None:
            self.paths[f"today: {why}"] += 1
            out = reserve(stats.piece_sizes(x)) if reserve is not None else None
            return stats.reduce_tensor(x, out, workspace, grad, units, unit_dim, edges)
        self.paths["fast"] += 1
        counts = None
        if edges is not None:
            counts = stats.reduce_tensor(x, None, workspace, grad, edges=edges)[1]
        return maxima, counts

    @staticmethod
    def _kind(grad: bool, units: bool) -> str:
        return "grad" if grad else "units" if units else "act"

    def _view(self, x: Tensor, units: bool, unit_dim: int | None) -> Tensor:
        x = x.detach()
        return _unit_view(x, unit_dim) if units else x.view(-1)

    def _fast(
        self, view: Tensor, reserve: Reserve | None, kind: str, shift: float | Tensor | None
    ) -> tuple[bool, Tensor | None]:
        """Write the row; ``(done, per-unit maxima with units)``, ``done`` false when it fell back (noted)."""
        if isinstance(shift, Tensor):
            shift_tensor = shift.detach().to(device=view.device, dtype=torch.float64).reshape(1)  # see _safe_shift
        else:
            shift_tensor = self._host_shift(0.0 if shift is None else shift, view.device)
        out = self._call(kind, view, shift_tensor)
        if out is None:
            return False, None
        values, maxima = out if kind == "units" else (out, None)
        if reserve is not None:
            reserve([view.numel()])[0].copy_(values)
        return True, maxima

    def _host_shift(self, shift: float, device: torch.device) -> Tensor:
        """A host number as the ``[1]`` float64 shift on ``device``; zero (every gradient's) is made there once.

        A tensor made from a host number on an accelerator is a copy from pageable memory, which waits for the
        device's queue: a synchronisation in every gradient's hook.
        """
        if shift != 0.0:
            return torch.tensor([shift], dtype=torch.float64, device=device)
        zero = self._zeros.get(device)
        if zero is None:
            with torch.inference_mode(False):  # usable outside the inference mode a hook may run under
                zero = self._zeros[device] = torch.zeros(1, dtype=torch.float64, device=device)
        return zero


_NO_COMPILER = {
    True: "no C++ compiler found for CPU kernels: every tensor takes the per-piece path",
    False: "no kernel compiler (Triton) for this device: every tensor takes the per-piece path",
}
