"""Parameter statistics around the optimizer step: weight norms, gradient norms and the update-to-weight ratio.

:class:`ParameterTracker` measures the norms with :func:`squared_norms` and the update as the change the optimizer
made to entries kept across the step (:func:`update_samples`), whichever optimizer it is. What is logged:
``docs/statistics.md#every-key``; the memory bound: ``docs/statistics.md#memory-bounded-scratch``; over shards:
``docs/integrations.md#sharded-parameters-fsdp-fsdp2-dtensor``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hookdiag import _stats as stats
from lightning_hookdiag._names import logged_name
from lightning_hookdiag._stats import chunks

__all__ = [
    "SNAPSHOT_ELEMENTS",
    "stride",
    "ParameterTracker",
    "finalize_parameters",
    "local_tensor",
    "named_parameters_of",
    "owned_parameters",
    "replicas",
    "real_view",
    "squared_norms",
    "stale_gradient_squares",
    "stored_values",
    "update_samples",
]

# Columns of the per-parameter state.
P_WEIGHT_SQ, P_GRAD_SQ, P_UPDATE_SQ, P_SEEN = range(4)
P_SLOTS = 4


def local_tensor(t: Tensor) -> Tensor:
    """The locally held part of ``t``: the shard of a ``DTensor``, ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def replicas(t: Tensor) -> int:
    """Number of processes that hold the same local part of ``t`` as this one (1 for a plain tensor).

    Sharded sums of squares are added over processes; dividing each by this count counts a replicated part once.
    For a ``DTensor``: the mesh sizes along its ``Replicate`` dimensions, times the copies of its mesh in the
    default process group, the one the sums are reduced over (every process tracks the same parameters, so a process
    outside a sub-mesh holds the parameter on a mesh of its own). FSDP2: 1; HSDP: the replicate size; a ``dp x tp``
    mesh, sharded over ``dp``: the ``tp`` size. A ``Partial`` placement (partial sums: their squares do not add up to
    the whole's) raises ``ValueError``, as does a mesh whose size does not divide the group's.
    """
    placements, mesh = getattr(t, "placements", None), getattr(t, "device_mesh", None)
    if placements is None or mesh is None:
        return 1
    within = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            within *= mesh.size(dim)
        elif not placement.is_shard():
            raise ValueError(
                f"replicas: expected Shard or Replicate placements on a parameter, got {placement!r} in {placements}"
            )
    dist = torch.distributed
    mesh_size: int = mesh.size()  # DeviceMesh.size(); found by getattr above, so untyped there
    group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else mesh_size
    if group_size % mesh_size:
        raise ValueError(
            f"replicas: the parameter's device mesh has {mesh_size} processes, which does not divide the"
            f" {group_size} processes its statistics are reduced over"
        )
    return within * (group_size // mesh_size)


def squared_norms(tensors: Sequence[Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
    """Sums of squares of each tensor, as one ``[len(tensors)]`` vector: finite for finite values of any magnitude.

    One fused ``_foreach_norm`` per dtype and device (one launch, not one per parameter; on the CPU, one per
    buffer-full of pieces: :func:`_norms`) over pieces of at most ``CHUNK_ELEMENTS`` (the scratch), accumulated in
    ``dtype`` (float64: a float32 square is exact there). Measures a ``DTensor``'s local part, a sparse tensor's
    stored values and a complex tensor's magnitudes (``|z|**2 = re**2 + im**2``, read as its real view); NaN and Inf
    propagate.

    Example:
        >>> [round(v, 4) for v in squared_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()]
        [25.0, 1.0]
        >>> f"{squared_norms([torch.tensor([3e20, 4e20])]).item():.6g}"
        '2.5e+41'
        >>> [round(v, 4) for v in squared_norms([torch.tensor([3 + 4j, 1j])]).tolist()]
        [26.0]
    """
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    local = [real_view(stored_values(local_tensor(t).detach())) for t in tensors]
    return _sum_squares([[(piece,) for piece in chunks(t)] for t in local], dtype)  # an empty tensor: one piece


def real_view(t: Tensor) -> Tensor:
    """``t``, or a complex ``t`` as its real view (a trailing dimension of 2): the same sum of squares, ``|z|**2``."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _sum_squares(
    parts: Sequence[Sequence[tuple[Tensor, ...]]], dtype: torch.dtype, workspace: _Workspace | None = None
) -> Tensor:
    # parts[i]: the pieces of tensor i, each (piece,) or (before, after) to subtract; one _norms per dtype and device.
    pieces = [piece for part in parts for piece in part]
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, piece in enumerate(pieces):
        groups.setdefault((piece[0].dtype, piece[0].device), []).append(i)
    if len(groups) == 1:  # the usual case: one dtype on one device, no reordering
        norms = _norms(*zip(*pieces, strict=True), dtype=dtype, workspace=workspace)
    else:
        norms = [pieces[0][0]] * len(pieces)
        first = pieces[0][0].device
        for members in groups.values():
            found = _norms(*zip(*(pieces[i] for i in members), strict=True), dtype=dtype, workspace=workspace)
            for i, norm in zip(members, found, strict=True):
                norms[i] = norm.to(first)
    squares = torch.stack(norms).square()
    if len(pieces) == len(parts):
        return squares
    per_tensor = squares.split([len(part) for part in parts])
    return torch.stack([part[0] if len(part) == 1 else part.sum() for part in per_tensor])


class _Workspace:
    """Buffers a :class:`ParameterTracker` keeps across sampled steps, so that none is allocated (page-faulted) again.

    The float64 scratch :func:`_norms` casts pieces into (``[2, CHUNK_ELEMENTS]`` per device, 4 MiB) with its views
    per batch of piece shapes, and the update snapshot (at most ``snapshot_elements`` entries per optimizer stepped in
    one window, in the weights' own dtype: 4 MiB of float32). They go with the tracker, at the fit's end.
    """

    def __init__(self) -> None:
        self._scratch: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._views: dict[tuple[Any, ...], list[Tensor]] = {}
        self._snapshots: dict[tuple[int, torch.dtype, torch.device], Tensor | None] = {}

    def scratch(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The ``[2, CHUNK_ELEMENTS]`` scratch of ``dtype`` on ``device`` (allocated again if the limit changed)."""
        buffer = self._scratch.get((device, dtype))
        if buffer is None or buffer.shape[1] != stats.CHUNK_ELEMENTS:
            self._forget_views([buffer])
            with torch.inference_mode(False):  # a buffer made in inference mode could not be written outside it
                buffer = torch.empty(2, stats.CHUNK_ELEMENTS, dtype=dtype, device=device)
            self._scratch[(device, dtype)] = buffer
        return buffer

    def views(self, buffer: Tensor, row: int, shapes: tuple[torch.Size, ...]) -> list[Tensor]:
        """Views of ``buffer[row]``, one per shape, packed from its start (kept: built once per batch layout)."""
        key = (id(buffer), row, shapes)
        found = self._views.get(key)
        if found is None:
            if len(self._views) >= 256:  # a bound: layouts change only with the parameter set
                self._views = {}
            numels = [math.prod(shape) for shape in shapes]
            places = buffer[row, : sum(numels)].split(numels)
            found = [place.view(shape) for place, shape in zip(places, shapes, strict=True)]
            self._views[key] = found
        return found

    def _forget_views(self, buffers: Iterable[Tensor | None]) -> None:
        # The views of these buffers only (a cached view keeps its buffer alive); the others' views stay valid.
        gone = {id(buffer) for buffer in buffers if buffer is not None}
        self._views = {key: views for key, views in self._views.items() if key[0] not in gone}

    def snapshot(self, slot: int, like: Sequence[Tensor]) -> list[Tensor]:
        """Places for copies of ``like`` in the ``slot``-th snapshot buffer of their dtype and device.

        The buffer is grown when a set does not fit, never allocated afresh for one that does.
        """
        first = like[0]
        key = (slot, first.dtype, first.device)
        shapes = tuple(t.shape for t in like)
        total = sum(t.numel() for t in like)
        buffer = self._snapshots.get(key)
        if buffer is None or buffer.shape[1] < total:
            self._forget_views([buffer])
            self._snapshots[key] = None  # the old buffer goes before the new one comes
            with torch.inference_mode(False):
                buffer = torch.empty(1, total, dtype=first.dtype, device=first.device)
            self._snapshots[key] = buffer
        return self.views(buffer, 0, shapes)


def _norms(
    pieces: tuple[Tensor, ...],
    minus: tuple[Tensor, ...] = (),
    *,
    dtype: torch.dtype,
    workspace: _Workspace | None = None,
) -> list[Tensor]:
    """The norms of ``pieces`` (of one dtype and device; minus ``minus``, if given) in ``dtype``, in bounded scratch.

    CUDA's fused kernel reads each piece in its own dtype; the CPU's casts every piece into a new buffer, which glibc's
    malloc may fail to reuse: +5 GB resident on a 329 M-parameter model, in some processes and not in others
    (``docs/statistics.md#memory-bounded-scratch``). There floating-point pieces that ``dtype`` widens are cast into
    one buffer of at most :data:`~lightning_hookdiag._stats.CHUNK_ELEMENTS` (allocated once per call), as many at a
    time as fit, and measured in it; the sums then run over each piece in its logical order, which can differ from
    the kernel's in the last bits for a non-contiguous piece. Other pieces take the kernel's own path. A difference
    is taken in ``dtype`` (in their own, bf16 weights' would be rounded to 8 bits): on every device in two such
    buffers, or in ``pieces`` themselves if they are in ``dtype`` already. With a ``workspace`` the buffer and its
    views are the ones kept there, not allocated again.
    """
    first = pieces[0]
    widens = first.is_floating_point() and dtype.is_floating_point and first.dtype.itemsize < dtype.itemsize
    if minus and not widens:
        torch._foreach_sub_(pieces, minus)
    if not widens or (first.device.type != "cpu" and not minus):
        return list(torch._foreach_norm(pieces, 2, dtype=dtype))
    numels = [p.numel() for p in pieces]  # each at most CHUNK_ELEMENTS (stats.chunks)
    if workspace is None:
        rows = 2 if minus else 1
        scratch = torch.empty(rows, min(sum(numels), stats.CHUNK_ELEMENTS), dtype=dtype, device=first.device)
        cached = _Workspace()  # views of this call's buffer only
    else:
        scratch, cached = workspace.scratch(first.device, dtype), workspace
    # Smallest first: the small pieces (biases, norms' weights) share buffer-fulls instead of each taking one after a
    # piece that filled the buffer (a 512 x 512 weight is one whole piece): about half the batches on the MLP.
    order = sorted(range(len(pieces)), key=numels.__getitem__)
    norms: list[Tensor] = list(pieces)
    start = 0
    while start < len(order):
        end, used = start + 1, numels[order[start]]
        while end < len(order) and used + numels[order[end]] <= scratch.shape[1]:
            end, used = end + 1, used + numels[order[end]]
        members = order[start:end]
        batch = [pieces[i] for i in members]
        shapes = tuple(p.shape for p in batch)
        views = cached.views(scratch, 0, shapes)
        torch._foreach_copy_(views, batch)
        if minus:
            subtrahends = cached.views(scratch, 1, shapes)
            torch._foreach_copy_(subtrahends, [minus[i] for i in members])
            torch._foreach_sub_(views, subtrahends)
        for i, norm in zip(members, torch._foreach_norm(views, 2), strict=True):
            norms[i] = norm
        start = end
    return norms


SNAPSHOT_ELEMENTS = 1 << 20
"""The most parameter entries :class:`ParameterTracker` keeps across an optimizer step (4 MiB of float32).

The buffer is kept across sampled steps (allocated once: afresh, its page faults cost ~5 ms a sampled step on a
12 MiB snapshot), so it is resident under every step's peak, next to the 4 MiB scratch: 8 MiB of the +16 MiB bound
for float32 weights (``docs/statistics.md#memory-bounded-scratch``).
"""


def update_samples(numels: Sequence[int], budget: int = SNAPSHOT_ELEMENTS) -> list[int]:
    """How many entries of each parameter to keep across the step: all of the small ones, a share of the large ones.

    Water-filling from the smallest up: each gets every entry while that fits its even share of what is left of
    ``budget``, the rest share it evenly; a model within ``budget`` is exact. The total stays within ``budget`` (the
    snapshot is kept between sampled steps) unless there are more parameters than entries, one each: a share is at
    least 1024 entries only where ``budget`` has 1024 for every parameter (a floor of 1024 each once kept 2 M entries
    for 2,000 weights of 4,096).

    Example:
        >>> update_samples([10, 5000, 100, 8000], budget=4000)
        [10, 1945, 100, 1945]
        >>> update_samples([10, 20], budget=4000)
        [10, 20]
        >>> sum(update_samples([4096] * 2000, budget=1 << 20)) <= 1 << 20
        True
    """
    taken = [0] * len(numels)
    left, waiting = budget, len(numels)
    floor = max(1, min(1024, budget // max(1, len(numels))))  # one entry each at the very least
    for i in sorted(range(len(numels)), key=numels.__getitem__):
        share = max(floor, left // waiting)
        taken[i] = min(numels[i], share)
        left, waiting = max(0, left - taken[i]), waiting - 1
    return taken


def _sample_view(t: Tensor, size: int, phase: int) -> Tensor:
    # At most size entries of t as a view: every k-th entry of its flat form, from phase % k on; as many whatever the
    # phase, so a scale computed once holds on every step. A tensor that is not contiguous is sampled along its
    # leading dimensions in turn, down to at most size entries (or one row). k is a prime that divides none of t's
    # sizes (stride): a stride of 9 on a [512, 512, 3, 3] conv weight read one kernel tap per step, the centre tap
    # (the only one with a gradient at 1 x 1 resolution) every 9th step, so the ratio swung 1000x between steps.
    if t.numel() <= size:
        return t
    if t.is_contiguous():
        return _every(t.view(-1), stride(math.ceil(t.numel() / size), tuple(t.shape)), phase)
    view = t
    while view.numel() > size and view.ndim:
        step = stride(math.ceil(view.numel() / size), tuple(view.shape))
        view = _every(view, min(view.shape[0], step), phase)
        if view.numel() > size and view.shape[0] == 1:
            view = view[0]
    return view


@functools.lru_cache(maxsize=1024)
def stride(least: int, sizes: tuple[int, ...]) -> int:
    """The smallest prime of at least ``least`` that divides none of ``sizes``: a sampling stride that cannot alias.

    Every k-th entry of a tensor whose rows, heads or kernel taps repeat with a period sharing a factor with k reads
    the same few positions of each period; a prime dividing no size (so no product of sizes) reads every position.

    Example:
        >>> stride(9, (512, 512, 3, 3)), stride(2, (64, 3)), stride(1, (4,))
        (11, 5, 3)
    """
    k = max(least, 2)
    while any(k % d == 0 for d in range(2, math.isqrt(k) + 1)) or any(n % k == 0 for n in sizes if n > 1):
        k += 1
    return k


def _every(t: Tensor, step: int, phase: int) -> Tensor:
    # Every step-th entry along dim 0 from phase % step on, always len(t) // step of them.
    start = phase % step
    return t[start : start + (t.shape[0] // step) * step : step]


def stored_values(t: Tensor) -> Tensor:
    """The values a sparse tensor stores (COO duplicates added up), ``t`` itself if it is dense.

    Same sum of squares and NaN/Inf as the dense form, for the gradients of ``nn.Embedding(sparse=True)``, on which
    dense reductions fail.

    Example:
        >>> stored_values(torch.sparse_coo_tensor([[0, 2, 2]], [3.0, 1.0, 3.0], (5,)))
        tensor([3., 4.])
    """
    if t.layout == torch.strided:
        return t
    return t.coalesce().values() if t.layout == torch.sparse_coo else t.values()


def stale_gradient_squares(params: Sequence[nn.Parameter], dtype: torch.dtype = torch.float64) -> Tensor | None:
    """Sums of squares of the ``.grad`` each parameter holds, as ``[len(params)]`` (0 where ``.grad`` is ``None``).

    Called before an optimizer step's first backward, where Lightning has set every gradient to ``None``: the usual
    cost is one ``is None`` test per parameter, no kernel. On the gradients' device; ``None`` if no ``.grad`` is held.

    Example:
        >>> a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
        >>> stale_gradient_squares([a, b]) is None
        True
        >>> b.grad = torch.full((3,), 2.0)
        >>> [round(v, 4) for v in stale_gradient_squares([a, b]).tolist()]
        [0.0, 12.0]
    """
    held = [i for i, p in enumerate(params) if p.grad is not None]
    if not held:
        return None
    squares = squared_norms([params[i].grad for i in held], dtype)  # type: ignore[misc]
    out = torch.zeros(len(params), dtype=dtype, device=squares.device)
    out[torch.tensor(held, device=squares.device)] = squares
    return out


def finalize_parameters(param_stats: Tensor) -> dict[str, Tensor]:
    """Per-parameter statistics from a pooled ``[n_params, P_SLOTS]`` state, and ``grad_norm_total``.

    ``param_seen`` is > 0 where stepped; ``grad_norm_total`` (``[1]``) is the L2 norm of all stepped gradients together.

    Example:
        >>> state = torch.tensor([[25.0, 4.0, 0.25, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
        >>> {k: v.tolist() for k, v in finalize_parameters(state).items()}  # doctest: +NORMALIZE_WHITESPACE
        {'param_norm': [5.0, 0.0], 'param_grad_norm': [2.0, 0.0], 'param_update_ratio': [0.1, nan],
         'param_seen': [1.0, 0.0], 'grad_norm_total': [2.0]}
    """
    weight = param_stats[:, P_WEIGHT_SQ].sqrt()
    seen = param_stats[:, P_SEEN]
    return {
        "param_norm": weight,
        "param_grad_norm": param_stats[:, P_GRAD_SQ].sqrt(),
        "param_update_ratio": param_stats[:, P_UPDATE_SQ].sqrt() / weight,
        "param_seen": seen,
        "grad_norm_total": (param_stats[:, P_GRAD_SQ] * (seen > 0)).sum().sqrt().reshape(1),
    }


def named_parameters_of(modules: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
    """Parameters of the selected modules under ``"<module name>.<parameter name>"``, each parameter once.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> list(named_parameters_of({"0": net[0], "1": net[1]}))
        ['0.weight', '0.bias']
    """
    found: dict[int, tuple[str, nn.Parameter]] = {}  # by identity: each parameter once, under its first name
    for module_name, module in modules.items():
        for param_name, param in module.named_parameters():
            found.setdefault(id(param), (f"{module_name}.{logged_name(param_name, module)}", param))
    return dict(found.values())


def owned_parameters(root: nn.Module, skip: Iterable[str] = ()) -> dict[str, nn.Parameter]:
    """Every parameter of ``root`` under ``"<owning module's name>.<attribute>"``, each parameter once.

    The owner holds the parameter directly, leaf or not (``attn.in_proj_weight``, a ViT's ``cls_token``), and is
    named like every layer (no ``_orig_mod``, DDP or checkpoint-wrapper segments); ``root``'s own keep a bare name.
    Parameters owned by the modules named (normalised) in ``skip`` (``exclude``) are left out.

    Example:
        >>> net = nn.Sequential(nn.MultiheadAttention(4, 2), nn.Linear(4, 1))
        >>> list(owned_parameters(net))
        ['0.in_proj_weight', '0.in_proj_bias', '0.out_proj.weight', '0.out_proj.bias', '1.weight', '1.bias']
    """
    skipped = set(skip)
    named = ((logged_name(path, root), param) for path, param in root.named_parameters())  # each once, first path
    return {name: param for name, param in named if name.rpartition(".")[0] not in skipped}


@dataclass(frozen=True)
class _Pattern:
    # The device constants of one set of stepped parameters. share: 1 / replicas per parameter, so that a replicated
    # shard counts once over processes (None, no work: all 1); sizes: entries kept across the step; snapshot_share:
    # share times numel / entries kept. A dataclass, not a NamedTuple, whose field index would shadow tuple.index.
    index: Tensor
    zeros: Tensor
    ones: Tensor
    share: Tensor | None
    sizes: list[int]
    snapshot_share: Tensor | None


class ParameterTracker:
    """Measures the tracked parameters of one optimizer step, in a constant number of fused ops.

    Results refer to parameters by their position in ``params``. With ``snapshot``, up to ``snapshot_elements``
    weight entries (see :func:`update_samples`) are kept across the step, for the update ratio.

    Example:
        >>> lin = nn.Linear(2, 1)
        >>> tracker = ParameterTracker(named_parameters_of({"lin": lin}), snapshot=True)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        >>> lin(torch.ones(1, 2)).sum().backward()
        >>> index, values = tracker.before_step(opt.param_groups)
        >>> opt.step()
        >>> sorted(index.tolist()), tracker.after_step()[1].shape
        ([0, 1], torch.Size([2]))
    """

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        snapshot: bool = True,
        dtype: torch.dtype = torch.float64,
        snapshot_elements: int = SNAPSHOT_ELEMENTS,
    ) -> None:
        self.params = list(params.values())
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self._snapshot_enabled = snapshot
        self.dtype = dtype
        self._snapshots: list[tuple[_Pattern, list[list[Tensor]], Sequence[Tensor]]] = []
        """Per stepped set: the entries kept of each local tensor as views in pieces, and the pieces' copies."""
        self._patterns: dict[tuple[tuple[int, ...], tuple[int, ...]], _Pattern] = {}
        self._snapshot_elements = snapshot_elements
        self._phase = 0
        """Where the strided samples start, advanced every snapshot: over steps they visit every entry."""
        self._workspace = _Workspace()
        """The scratch kept across sampled steps (allocated once) and the snapshot of the step being measured."""

    def _pattern(self, positions: tuple[int, ...], local: list[Tensor], device: torch.device) -> _Pattern:
        # One host-to-device copy per distinct parameter set and sizes (a resized embedding), not per step. A few
        # are kept: the set changes whenever a parameter gets no gradient (a skipped block, an expert without tokens).
        numels = tuple(t.numel() for t in local)
        cached = self._patterns.get((positions, numels))
        if cached is not None and cached.index.device == device:
            return cached
        if len(self._patterns) >= 8:
            self._patterns = {}
        share = self._vector([1 / replicas(self.params[i]) for i in positions], device)
        sizes = update_samples(numels, self._snapshot_elements) if self._snapshot_enabled else []
        kept = [_sample_view(t, size, 0).numel() for t, size in zip(local, sizes, strict=False)]
        scale = self._vector([n / max(k, 1) for n, k in zip(numels, kept, strict=False)], device)
        snapshot_share = share if scale is None else scale if share is None else share * scale
        zeros = torch.zeros(len(positions), dtype=self.dtype, device=device)
        index = torch.tensor(positions, dtype=torch.long, device=device)
        cached = _Pattern(index, zeros, torch.ones_like(zeros), share, sizes, snapshot_share)
        self._patterns[(positions, numels)] = cached
        return cached

    def _vector(self, values: list[float], device: torch.device) -> Tensor | None:
        return None if all(v == 1 for v in values) else torch.tensor(values, dtype=self.dtype, device=device)

    @torch.no_grad()
    def before_step(self, param_groups: Iterable[dict[str, Any]]) -> tuple[Tensor, Tensor] | None:
        """Weight and gradient norms of the tracked parameters an optimizer (its ``param_groups``) is about to step.

        ``(index, values)``: positions of the measured parameters and a ``[n, P_SLOTS]`` matrix of weight sum of
        squares, gradient sum of squares, zero update (filled in by :meth:`after_step`) and 1 (seen); those of a
        ``DTensor`` are this process's share of the whole (see :func:`replicas`); ``None`` if the optimizer steps none
        of the tracked parameters with a gradient.
        """
        found = [(self._position.get(id(p)), p) for group in param_groups for p in group["params"]]
        positions = [pos for pos, p in found if pos is not None and p.requires_grad and p.grad is not None]
        if not positions:
            return None
        # Under no_grad, read as they are (a detach per tensor is a view op each: 196 on a model of 98 parameters).
        local = [real_view(local_tensor(self.params[i])) for i in positions]  # complex: its real view
        grads: list[Tensor] = [self.params[i].grad for i in positions]  # type: ignore[misc]
        squares = self._squared_norms(local, grads)
        weight_sq, grad_sq = squares[: len(local)], squares[len(local) :]
        pattern = self._pattern(tuple(positions), local, squares.device)
        if pattern.share is not None:
            weight_sq, grad_sq = weight_sq * pattern.share, grad_sq * pattern.share
        values = torch.stack([weight_sq, grad_sq, pattern.zeros, pattern.ones], dim=1)
        if self._snapshot_enabled:
            phase, self._phase = self._phase, self._phase + 1
            kept = [_sample_view(t, size, phase) for t, size in zip(local, pattern.sizes, strict=True)]
            current = [list(chunks(t)) for t in kept]  # copied in pieces: each pairs with its view after the step
            self._snapshots.append((pattern, current, self._copy([p for part in current for p in part])))
        return pattern.index, values

    def _squared_norms(self, local: list[Tensor], grads: list[Tensor]) -> Tensor:
        # squared_norms of the weights' local parts (already read as such) and of the gradients, with the scratch kept
        # in the workspace. A tensor of one piece (every one of a model of small layers) skips the generator.
        readable = [*local, *(real_view(stored_values(local_tensor(g))) for g in grads)]
        limit = stats.CHUNK_ELEMENTS
        parts = [[(t,)] if t.numel() <= limit else [(piece,) for piece in chunks(t)] for t in readable]
        return _sum_squares(parts, self.dtype, self._workspace)

    def _copy(self, pieces: list[Tensor]) -> list[Tensor]:
        """Copies of ``pieces`` in the workspace's snapshot buffers: one per dtype and device, per snapshot open."""
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, piece in enumerate(pieces):
            groups.setdefault((piece.dtype, piece.device), []).append(i)
        copies: list[Tensor] = list(pieces)
        slot = len(self._snapshots)  # another optimizer stepped in the same window: a buffer of its own
        for members in groups.values():
            sources = [pieces[i] for i in members]
            places = self._workspace.snapshot(slot, sources)
            torch._foreach_copy_(places, sources)
            for i, place in zip(members, places, strict=True):
                copies[i] = place
        return copies

    @torch.no_grad()
    def after_step(self) -> tuple[Tensor, Tensor] | None:
        """Squared norms of ``w_after - w_before`` for the parameters snapshotted since the last call.

        Exact for parameters kept whole; for a sampled one, the sum of squares of the kept entries' updates times
        ``numel / entries kept`` (an estimate; its error is in ``docs/statistics.md#every-key``). Returns ``(index,
        update_sq)``, ``None`` if nothing was snapshotted, and releases the snapshot.
        """
        if not self._snapshots:
            return None
        indices, updates = [], []
        for pattern, current, before in self._snapshots:
            indices.append(pattern.index)
            copies = iter(before)  # not read again: the difference may be taken in place in them
            pairs = [[(next(copies), piece) for piece in part] for part in current]
            update_sq = _sum_squares(pairs, self.dtype, self._workspace).to(pattern.index.device)
            updates.append(update_sq if pattern.snapshot_share is None else update_sq * pattern.snapshot_share)
        self._snapshots = []  # measured; the buffers stay for the next sampled step
        if len(indices) == 1:
            return indices[0], updates[0]
        return torch.cat(indices), torch.cat(updates)

    def release(self) -> None:
        """Drop any pending snapshot without measuring it (its buffer stays, for the next sampled step)."""
        self._snapshots = []
