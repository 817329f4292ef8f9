"""Parameter statistics around the optimizer step: weight norms, gradient norms and the update-to-weight ratio.

The update ratio needs the weights from before the step. :class:`ParameterTracker` keeps, across the step, a copy
of a bounded set of entries of each tracked parameter (every entry of the small ones; an evenly strided sample of
the large ones, see :func:`update_samples`) and subtracts the new values from it in ``after_step``: the memory is at
most :data:`SNAPSHOT_ELEMENTS` elements whatever the size of the model, and what is measured is the change the
optimizer made to the stored values, whichever optimizer it is (``docs/statistics.md#memory-bounded-scratch``).

Every norm is a fused ``torch._foreach_norm`` over pieces of at most
:data:`~lightning_hookdiag.stats.CHUNK_ELEMENTS` elements of the parameters of one dtype and device (one kernel
launch per group of tensors on an accelerator, not one per parameter), accumulated in float64 so that squares of
any float32 magnitude neither overflow nor underflow. A CUDA device reads each piece in its own dtype and
accumulates in float64; the CPU casts one piece at a time, so no whole parameter is ever copied to float64.

What the logged values are: ``docs/statistics.md#every-key``; over shards:
``docs/integrations.md#sharded-parameters-fsdp-fsdp2-dtensor``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_hookdiag.names import logged_name
from lightning_hookdiag.stats import chunks

__all__ = [
    "SNAPSHOT_ELEMENTS",
    "ParameterTracker",
    "finalize_parameters",
    "local_tensor",
    "named_parameters_of",
    "owned_parameters",
    "replicas",
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


def replicas(t: Tensor, group_size: int | None = None) -> int:
    """Number of processes that hold the same local part of ``t`` as this one: 1 for a plain tensor.

    Sharded sums of squares are added over processes; dividing each by this count counts a replicated part once.
    For a ``DTensor`` it comes from the tensor's own device mesh and placements: the product of the mesh sizes along
    ``Replicate`` dimensions (``Shard`` dimensions hold distinct parts), times the number of copies of the mesh in
    the reduction group when the mesh is a sub-mesh of it (every process tracks the same parameters, so a process
    outside this mesh holds the same parameter on a mesh of its own: a tensor-parallel replica of a data-parallel
    sub-mesh). For FSDP2 that is 1; for HSDP the replicate size; on a ``dp x tp`` mesh, for a parameter sharded over
    ``dp`` only, the ``tp`` size.

    Args:
        t: A parameter, plain or ``DTensor``.
        group_size: Processes the sums are reduced over; ``None`` for the default group's (1 without one).

    Raises:
        ValueError: For a ``Partial`` placement (partial sums: their squares do not add up to the whole's), or a
            mesh whose size does not divide ``group_size``.

    Example:
        >>> replicas(torch.zeros(3))
        1
    """
    placements = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
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
    if group_size is None:
        dist = torch.distributed
        group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else mesh.size()
    if group_size % mesh.size():
        raise ValueError(
            f"replicas: the parameter's device mesh has {mesh.size()} processes, which does not divide the"
            f" {group_size} processes its statistics are reduced over"
        )
    return within * (group_size // mesh.size())


def squared_norms(tensors: Sequence[Tensor], dtype: torch.dtype = torch.float64) -> Tensor:
    """Sums of squares of each tensor, as one ``[len(tensors)]`` vector: finite for finite values of any magnitude.

    Each tensor is cut into pieces of at most :data:`~lightning_hookdiag.stats.CHUNK_ELEMENTS` elements (views, no
    copy); one fused ``_foreach_norm`` per dtype and device measures every piece, accumulated in ``dtype`` (float64:
    a float32 value's square is exact there and cannot overflow), then one ``stack`` and one ``square``, plus one
    ``sum`` for each tensor of several pieces. The scratch memory is that of one piece, never a whole tensor. The
    local part of a ``DTensor`` and the stored values of a sparse tensor are what is measured. NaN and Inf
    propagate to their tensor's entry.

    Example:
        >>> [round(v, 4) for v in squared_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()]
        [25.0, 1.0]
        >>> f"{squared_norms([torch.tensor([3e20, 4e20])]).item():.6g}"
        '2.5e+41'
    """
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    local = [stored_values(local_tensor(t).detach()) for t in tensors]
    pieces: list[Tensor] = []
    counts: list[int] = []
    for t in local:
        parts = list(chunks(t))  # an empty tensor is one (empty) piece
        pieces.extend(parts)
        counts.append(len(parts))
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(pieces):
        groups.setdefault((t.dtype, t.device), []).append(i)
    norms: list[Tensor] = [pieces[0]] * len(pieces)
    for members in groups.values():
        for i, norm in zip(members, torch._foreach_norm([pieces[i] for i in members], 2, dtype=dtype), strict=True):
            norms[i] = norm
    device = local[0].device
    squares = torch.stack([norm.to(device) for norm in norms]).square()
    if len(pieces) == len(local):
        return squares
    per_tensor = squares.split(counts)
    return torch.stack([part[0] if len(part) == 1 else part.sum() for part in per_tensor])


SNAPSHOT_ELEMENTS = 1 << 22
"""The most parameter entries :class:`ParameterTracker` keeps across an optimizer step, over all parameters (16 MiB of
float32); see :func:`update_samples`."""

_MIN_SAMPLE = 1024


def update_samples(numels: Sequence[int], budget: int = SNAPSHOT_ELEMENTS) -> list[int]:
    """How many entries of each parameter to keep across the step: all of the small ones, a share of the large ones.

    Water-filling: parameters are served from the smallest up, each with every entry while that fits its even share
    of what is left of ``budget``; the others share the rest evenly, with at least 1024 entries each. A model whose
    parameters add up to at most ``budget`` entries is measured exactly.

    Args:
        numels: Element count of each parameter.
        budget: The entries to share out.

    Example:
        >>> update_samples([10, 5000, 100, 8000], budget=4000)
        [10, 1945, 100, 1945]
        >>> update_samples([10, 20], budget=4000)
        [10, 20]
    """
    taken = [0] * len(numels)
    left, waiting = budget, len(numels)
    for i in sorted(range(len(numels)), key=numels.__getitem__):
        share = max(_MIN_SAMPLE, left // waiting)
        taken[i] = min(numels[i], share)
        left, waiting = max(0, left - taken[i]), waiting - 1
    return taken


def _sample_view(t: Tensor, size: int, phase: int) -> Tensor:
    """At most ``size`` entries of ``t`` as a view: every ``k``-th entry of its flat form, from ``phase % k`` on.

    The view holds the same number of entries whatever the phase (``numel // k``), so the scale computed once for a
    parameter set holds on every step. A tensor that is not contiguous is sampled the same way along its leading
    dimension, then its next ones, until the view holds at most ``size`` entries (or a single row of it).
    """
    if t.numel() <= size:
        return t
    if t.is_contiguous():
        return _every(t.view(-1), math.ceil(t.numel() / size), phase)
    view = t
    while view.numel() > size and view.ndim:
        view = _every(view, min(view.shape[0], math.ceil(view.numel() / size)), phase)
        if view.numel() > size and view.shape[0] == 1:
            view = view[0]
    return view


def _every(t: Tensor, step: int, phase: int) -> Tensor:
    # Every step-th entry along dim 0 from phase % step on, always len(t) // step of them.
    start = phase % step
    return t[start : start + (t.shape[0] // step) * step : step]


def stored_values(t: Tensor) -> Tensor:
    """The values a sparse tensor stores (duplicates of a COO tensor added up), ``t`` itself if it is dense.

    Same sum of squares and the same NaN/Inf as the dense form: ``nn.Embedding(sparse=True)`` hands the optimizer
    such gradients, on which dense reductions fail.

    Example:
        >>> stored_values(torch.sparse_coo_tensor([[0, 2, 2]], [3.0, 1.0, 3.0], (5,)))
        tensor([3., 4.])
    """
    if t.layout == torch.strided:
        return t
    return t.coalesce().values() if t.layout == torch.sparse_coo else t.values()


def stale_gradient_squares(params: Sequence[nn.Parameter], dtype: torch.dtype = torch.float64) -> Tensor | None:
    """Sums of squares of the ``.grad`` each parameter holds, as ``[len(params)]`` (0 where ``.grad`` is ``None``).

    Called before an optimizer step's first backward, when every gradient should be ``None`` or zero: Lightning's
    automatic optimization zeroes them (``set_to_none``) just before it, so the usual cost is one ``is None`` test
    per parameter and no kernel at all. Only parameters that still hold a gradient are measured, in one fused pass.

    Returns:
        The vector, on the gradients' device, or ``None`` if no parameter holds a gradient.

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
    """Turn a pooled ``[n_params, P_SLOTS]`` state into per-parameter statistics.

    Returns:
        ``param_norm``, ``param_grad_norm`` and ``param_update_ratio`` (``[n_params]``), ``param_seen``
        (``[n_params]``, > 0 where the parameter was stepped) and ``grad_norm_total`` (``[1]``: the L2 norm of all
        stepped gradients together).

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
    found: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module_name, module in modules.items():
        for param_name, param in module.named_parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            found[f"{module_name}.{logged_name(param_name, module)}"] = param
    return found


def owned_parameters(root: nn.Module, skip: Iterable[str] = ()) -> dict[str, nn.Parameter]:
    """Every parameter of ``root`` under ``"<owning module's name>.<attribute>"``, each parameter once.

    The owner is the module that holds the parameter directly, leaf or not (``attn.in_proj_weight`` of an
    ``nn.MultiheadAttention``, ``cls_token`` of a ViT); its name is normalised like every layer name (no
    ``_orig_mod``, DDP ``module`` or checkpoint-wrapper segments). Parameters of ``root`` itself keep their bare
    attribute name.

    Args:
        root: The module whose parameters to list (the LightningModule).
        skip: Normalised names of modules whose own parameters are left out (``exclude``).

    Example:
        >>> net = nn.Sequential(nn.MultiheadAttention(4, 2), nn.Linear(4, 1))
        >>> list(owned_parameters(net))
        ['0.in_proj_weight', '0.in_proj_bias', '0.out_proj.weight', '0.out_proj.bias', '1.weight', '1.bias']
    """
    skipped = set(skip)
    found: dict[str, nn.Parameter] = {}
    for path, param in root.named_parameters():  # each parameter once, under its first path
        name = logged_name(path, root)
        if name.rpartition(".")[0] not in skipped:
            found[name] = param
    return found


@dataclass
class _Snapshot:
    index: Tensor
    current: list[Tensor]
    """Views of the entries kept of each stepped parameter's local tensor."""
    before: list[Tensor]
    """Their copies from before the step."""
    share: Tensor | None
    """Per parameter: 1 / replicas times ``numel / entries kept`` (the sampled share's scale); ``None`` for all 1."""


class ParameterTracker:
    """Measures the tracked parameters of one optimizer step, in a constant number of fused ops.

    Args:
        params: ``{name: parameter}``; results refer to parameters by their position in this mapping.
        snapshot: Keep entries of the weights across the step, for the update ratio (at most ``snapshot_elements``
            of them, see :func:`update_samples`).
        dtype: Of the sums of squares.
        snapshot_elements: The budget of entries kept across a step.

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
        self.names = list(params)
        self.params = list(params.values())
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self._snapshot_enabled = snapshot
        self.dtype = dtype
        self._snapshots: list[_Snapshot] = []
        self._index_cache: dict[tuple[int, ...], tuple[Tensor, Tensor, Tensor]] = {}
        self._share_cache: dict[tuple[int, ...], Tensor | None] = {}
        self._snapshot_elements = snapshot_elements
        self._sample_cache: dict[tuple[int, ...], tuple[list[int], Tensor | None]] = {}
        self._phase = 0
        """Where the strided samples start, advanced every snapshot: over steps they visit every entry."""

    @property
    def held(self) -> tuple[int, int]:
        """``(weight elements in snapshots, index patterns cached)``: both bounded, whatever the model."""
        return sum(b.numel() for snap in self._snapshots for b in snap.before), len(self._index_cache)

    def _index(self, positions: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        # The positions and the constant columns (update 0, seen 1) on the device: one host-to-device copy per
        # distinct parameter set, not per step. A few sets are kept (the set changes whenever a parameter gets no
        # gradient: a skipped block, an expert without tokens).
        cached = self._index_cache.get(positions)
        if cached is None or cached[0].device != device:
            if len(self._index_cache) >= 8:
                self._index_cache, self._share_cache = {}, {}
            index = torch.tensor(positions, dtype=torch.long, device=device)
            zeros = torch.zeros(len(positions), dtype=self.dtype, device=device)
            cached = self._index_cache[positions] = (index, zeros, torch.ones_like(zeros))
        return cached

    def _share(self, positions: tuple[int, ...], device: torch.device) -> Tensor | None:
        # 1 / replicas per parameter, so that the sum over processes of a replicated shard counts it once; None where
        # every parameter's local part is held by this process alone (no work at all, the common case).
        if positions not in self._share_cache:
            counts = [replicas(self.params[i]) for i in positions]
            share = None
            if any(c != 1 for c in counts):
                share = torch.tensor([1.0 / c for c in counts], dtype=self.dtype, device=device)
            self._share_cache[positions] = share
        return self._share_cache[positions]

    @torch.no_grad()
    def before_step(self, param_groups: Iterable[dict]) -> tuple[Tensor, Tensor] | None:
        """Weight and gradient norms of the tracked parameters an optimizer is about to step.

        Args:
            param_groups: The optimizer's ``param_groups``.

        Returns:
            ``(index, values)``: positions of the measured parameters and a ``[n, P_SLOTS]`` matrix of weight
            sum of squares, gradient sum of squares, zero update (filled in by :meth:`after_step`) and 1 (seen);
            sums of squares of a ``DTensor`` are this process's share of the whole (see :func:`replicas`);
            ``None`` if the optimizer steps none of the tracked parameters with a gradient.
        """
        positions: list[int] = []
        for group in param_groups:
            for p in group["params"]:
                pos = self._position.get(id(p))
                if pos is not None and p.requires_grad and p.grad is not None:
                    positions.append(pos)
        if not positions:
            return None
        key = tuple(positions)
        local = [local_tensor(self.params[i]).detach() for i in key]
        grads: list[Tensor] = [self.params[i].grad for i in key]  # type: ignore[misc]
        squares = squared_norms([*local, *grads], self.dtype)
        n = len(local)
        weight_sq, grad_sq = squares[:n], squares[n:]
        index, zeros, ones = self._index(key, squares.device)
        share = self._share(key, squares.device)
        if share is not None:
            weight_sq, grad_sq = weight_sq * share, grad_sq * share
        values = torch.stack([weight_sq, grad_sq, zeros, ones], dim=1)
        if self._snapshot_enabled:
            sizes, scale = self._samples(key, local, squares.device)
            phase, self._phase = self._phase, self._phase + 1
            current = [_sample_view(t, size, phase) for t, size in zip(local, sizes, strict=True)]
            if scale is not None:
                share = scale if share is None else share * scale
            self._snapshots.append(_Snapshot(index, current, torch._foreach_mul(current, 1.0), share))
        return index, values

    def _samples(
        self, positions: tuple[int, ...], local: list[Tensor], device: torch.device
    ) -> tuple[list[int], Tensor | None]:
        # Entries kept of each parameter, and numel / kept where that is not 1 (the sampled share's scale, on the
        # device once per distinct parameter set).
        numels = [t.numel() for t in local]
        key = (*positions, *numels)  # a parameter can change shape between steps (resized embeddings)
        cached = self._sample_cache.get(key)
        if cached is None or (cached[1] is not None and cached[1].device != device):
            if len(self._sample_cache) >= 8:
                self._sample_cache = {}
            sizes = update_samples(numels, self._snapshot_elements)
            kept = [_sample_view(t, size, 0).numel() for t, size in zip(local, sizes, strict=True)]
            scale = None
            if kept != numels:
                scale = torch.tensor([n / max(k, 1) for n, k in zip(numels, kept, strict=True)], dtype=self.dtype)
                scale = scale.to(device)
            cached = self._sample_cache[key] = (sizes, scale)
        return cached

    @torch.no_grad()
    def after_step(self) -> tuple[Tensor, Tensor] | None:
        """Squared norms of ``w_after - w_before`` for the parameters snapshotted since the last call.

        Exact for parameters kept whole; for a sampled one, the sum of squares of the kept entries' updates times
        ``numel / entries kept`` (an estimate; its error is in ``docs/statistics.md#every-key``).

        Returns:
            ``(index, update_sq)`` or ``None`` if nothing was snapshotted. The snapshot is released.
        """
        if not self._snapshots:
            return None
        indices, updates = [], []
        for snapshot in self._snapshots:
            indices.append(snapshot.index)
            # In place on the copies, which are not read again: no second weight-sized allocation.
            torch._foreach_sub_(snapshot.before, snapshot.current)
            update_sq = squared_norms(snapshot.before, self.dtype).to(snapshot.index.device)
            updates.append(update_sq if snapshot.share is None else update_sq * snapshot.share)
        self._snapshots = []
        if len(indices) == 1:
            return indices[0], updates[0]
        return torch.cat(indices), torch.cat(updates)

    def release(self) -> None:
        """Drop any pending snapshot without measuring it."""
        self._snapshots = []
