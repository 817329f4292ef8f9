"""Parameter statistics around the optimizer step: weight norms, gradient norms and the update-to-weight ratio.

The update ratio needs the weights from before the step: :class:`ParameterTracker` copies the tracked parameters in
``before_step`` and subtracts the new weights from the copy in ``after_step``.

On an accelerator every reduction is a fused ``torch._foreach_norm`` over all parameters at once (one kernel, not one
per parameter), and the copy is taken from the caching allocator on each sampled step and dropped after it. In host
memory (see :func:`~lightning_hookdiag.stats.reads_on_host`) passes over memory, not kernel launches, are the cost
of large parameters: each one's copy is reduced while it is still in cache (right after ``copy_``/``sub_``), and the
copy lives in buffers kept across sampled steps, because fresh host memory is page-faulted in on every use. Measured
on the 12 MiB benchmark MLP (2-core CPU): 6.4 ms per sampled step with fused norms and a fresh copy, 4.9 ms this way.
Small float32 parameters are the opposite case, a few torch calls each being their whole cost: they go through one
:class:`HostPack`, a handful of calls for all of them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_hookdiag import stats as S
from lightning_hookdiag.names import logged_name

__all__ = [
    "HostPack",
    "ParameterTracker",
    "finalize_parameters",
    "local_tensor",
    "named_parameters_of",
    "owned_parameters",
    "replicas",
    "squared_norms",
    "stale_gradient_squares",
    "stored_values",
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

    In host memory, :func:`~lightning_hookdiag.stats.host_square_sum` per tensor (torch's own row reductions,
    within ~3e-7 of float64 on any CPU; a float32 BLAS ``dot`` was 1e-4 off on an AMD EPYC and overflows above
    1.8e19). On an accelerator, fused ``_foreach_norm`` passes with an exact power-of-two prescaling per tensor
    (absolute maxima, a prescaled copy, norms), so squares neither overflow nor underflow float32 and nothing is
    read back to the host.

    Example:
        >>> [round(v, 4) for v in squared_norms([torch.tensor([3.0, 4.0]), torch.tensor([1.0])]).tolist()]
        [25.0, 1.0]
        >>> f"{squared_norms([torch.tensor([3e20, 4e20])]).item():.6g}"
        '2.5e+41'
    """
    if not tensors:
        return torch.zeros(0, dtype=dtype)
    local = [_as_float(stored_values(local_tensor(t).detach())) for t in tensors]
    if all(S.reads_on_host(t) for t in local):
        return _squares(local, dtype)
    absmax = torch.stack(torch._foreach_norm(local, math.inf))
    scale, exponent = S.power_of_two(absmax)
    scaled = torch._foreach_mul(local, list(scale.unbind()))
    norms = torch.stack(torch._foreach_norm(scaled, 2, dtype=dtype))
    return norms.square() * torch.exp2(2 * exponent.to(dtype))


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


def _as_float(t: Tensor) -> Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()  # fp16/bf16 squares overflow or round


def _host_square(t: Tensor) -> float:
    """Sum of squares of a host tensor as a float; NaN or Inf where it holds one (the branch-free path keeps it)."""
    flat = _as_float(t).reshape(-1)
    square = S.host_square_sum(flat)
    return S.square_sum(flat).item() if square is None else square


_PACKED = 1 << 16
"""Float32 host tensors up to this many elements are packed together (see :class:`HostPack`)."""
_WIDE = 1 << 20
"""Elements of the float64 scratch of a :class:`HostPack` (8 MiB): its sums of squares go in chunks of this size."""


def _packable(t: Tensor) -> bool:
    return (
        type(t) in (Tensor, nn.Parameter)  # not a DTensor or another subclass
        and t.dtype == torch.float32
        and 0 < t.numel() <= _PACKED
        and t.layout == torch.strided
        and S.reads_on_host(t)
    )


class HostPack:
    """Small float32 host tensors of fixed shapes, packed into one flat buffer grouped by size.

    Many small parameters (a model of narrow layers) would otherwise cost a few torch calls each, per quantity, per
    sampled step (a ``cat`` of their flattened views alone took 0.18 ms for 98 parameters). One ``_foreach_copy_``
    or ``_foreach_sub_`` writes them all (float32 to float32: with a float64 buffer they take torch's slow path,
    0.1 and 0.3 ms for 98 parameters). Their sums of squares are, per chunk of equally sized tensors (at most
    :data:`_WIDE` elements), one copy into float64 scratch and one row norm. A float32 value is exact in float64 and
    its square can neither overflow nor underflow there (no prescaling); a NaN or Inf reaches its tensor's sum as in
    the per-tensor path. Buffer and scratch are kept by the pack's owner across steps: fresh host memory would be
    page-faulted in on every sampled step.

    Args:
        shapes: The shapes of the tensors, in the order :meth:`load` receives them.
        split: The first ``split`` tensors are packed apart from the rest, so that :meth:`squares` can sum them
            alone (the tracker's weights, apart from their gradients); ``None`` for all together.

    Example:
        >>> pack = HostPack([torch.Size([2]), torch.Size([1, 1]), torch.Size([2])])
        >>> tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[2.0]]), torch.tensor([2.0**100, 0.0])]
        >>> pack.load(tensors).squares().tolist()
        [25.0, 4.0, 1.6069380442589903e+60]
        >>> pack.views[1]
        tensor([[2.]])
    """

    def __init__(self, shapes: Sequence[torch.Size], split: int | None = None) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        self._split = len(shapes) if split is None else split

        def key(i: int) -> tuple[bool, int]:
            return (i >= self._split, sizes[i])

        order = sorted(range(len(shapes)), key=key)
        self.flat = torch.zeros(sum(sizes), dtype=torch.float32)  # a part never loaded reads as zeros
        self.views: list[Tensor] = [self.flat] * len(shapes)
        """One view of the buffer per tensor, in the given order and shape."""
        self._chunks: list[Tensor] = []  # [rows, size] views of the buffer, in packed order
        self._first_chunks = 0  # chunks of the first `split` tensors, which come first
        offset = 0
        for (second, size), group in itertools.groupby(order, key=key):
            members = list(group)
            per_chunk = max(1, _WIDE // size)
            for start in range(0, len(members), per_chunk):
                rows = len(members[start : start + per_chunk])
                self._chunks.append(self.flat[offset + start * size : offset + (start + rows) * size].view(rows, size))
                self._first_chunks += not second
            for i in members:
                self.views[i] = self.flat[offset : offset + size].view(shapes[i])
                offset += size
        self._wide = torch.empty(max((c.numel() for c in self._chunks), default=0), dtype=torch.float64)
        # Sums come out in packed (size) order; this index puts them back in the given order.
        self._unsort = torch.empty(len(order), dtype=torch.long)
        self._unsort[order] = torch.arange(len(order))

    def load(self, tensors: Sequence[Tensor]) -> HostPack:
        """Copy ``tensors`` into the views of the first ``len(tensors)`` shapes (the first part only, or all)."""
        torch._foreach_copy_(self.views[: len(tensors)], list(tensors))
        return self

    def subtract(self, tensors: Sequence[Tensor]) -> HostPack:
        """Subtract ``tensors`` in place from the views of the first ``len(tensors)`` shapes."""
        torch._foreach_sub_(self.views[: len(tensors)], list(tensors))
        return self

    def squares(self, dtype: torch.dtype = torch.float64, first: bool = False) -> Tensor:
        """The sum of squares of each packed tensor, in the order of the shapes, as a ``[len(shapes)]`` vector.

        Args:
            dtype: Of the result.
            first: Only the first ``split`` tensors (a ``[split]`` vector).
        """
        norms = []
        for chunk in self._chunks[: self._first_chunks] if first else self._chunks:
            wide = self._wide[: chunk.numel()].view(chunk.shape).copy_(chunk)
            norms.append(torch.linalg.vector_norm(wide, dim=1))
        unsort = self._unsort[: self._split] if first else self._unsort
        if not norms:  # no tensor (in the part asked for)
            return torch.zeros(len(unsort), dtype=dtype)
        return torch.cat(norms)[unsort].square_().to(dtype)


def _squares(tensors: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """Sums of squares of host tensors: the packable ones through one :class:`HostPack`, the others one by one."""
    packed = [i for i, t in enumerate(tensors) if _packable(t)]
    skip = set(packed)
    squares = torch.tensor([0.0 if i in skip else _host_square(t) for i, t in enumerate(tensors)], dtype=dtype)
    if packed:
        squares[packed] = HostPack([tensors[i].shape for i in packed]).load([tensors[i] for i in packed]).squares(dtype)
    return squares


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


def _joined(parts: list[Tensor], device: torch.device) -> Tensor:
    """``parts`` concatenated on ``device``; the part itself when there is one (all packed, or none)."""
    if len(parts) == 1 and parts[0].device == device:
        return parts[0]
    return torch.cat([part.to(device) for part in parts])


@dataclass
class _Layout:
    """How the parameters one optimizer steps are measured: small float32 host ones packed, the others one by one."""

    positions: tuple[int, ...]
    """The parameters' positions, packed ones first, in the order of the measured values."""
    packed: list[nn.Parameter]
    rest: list[nn.Parameter]
    pack: HostPack | None
    """The packed weights, then their gradients: one copy and one pass for both. The weights are the snapshot
    across the step, kept across sampled steps."""
    signature: list[tuple[torch.Size, torch.dtype, bool]]
    """Shape, dtype and host residence of each packed parameter when the pack was built."""


def _signature(params: Sequence[Tensor]) -> list[tuple[torch.Size, torch.dtype, bool]]:
    return [(p.shape, p.dtype, S.reads_on_host(p)) for p in params]


@dataclass
class _Snapshot:
    index: Tensor
    packed: list[nn.Parameter]
    pack: HostPack | None
    current: list[Tensor]
    """The unpacked parameters' local tensors."""
    before: list[Tensor]
    """Their copies from before the step."""
    share: Tensor | None


class ParameterTracker:
    """Measures the tracked parameters of one optimizer step.

    Small float32 parameters in host memory are measured together through a :class:`HostPack` (a few torch calls
    for all of them), the others one by one: see the module docstring.

    Args:
        params: ``{name: parameter}``; results refer to parameters by their position in this mapping.
        snapshot: Keep a copy of the weights across the step, for the update ratio.

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
        self, params: dict[str, nn.Parameter], snapshot: bool = True, dtype: torch.dtype = torch.float64
    ) -> None:
        self.names = list(params)
        self.params = list(params.values())
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self._snapshot_enabled = snapshot
        self.dtype = dtype
        self._snapshots: list[_Snapshot] = []
        self._host_buffers: dict[int, Tensor] = {}
        self._layouts: dict[tuple[int, ...], _Layout] = {}
        self._used: set[tuple[int, ...]] = set()  # parameter sets stepped since the last prune
        self._index_cache: dict[tuple[int, ...], Tensor] = {}
        self._share_cache: dict[tuple[int, ...], Tensor | None] = {}

    def _layout(self, positions: tuple[int, ...]) -> _Layout:
        # Built once per distinct parameter set: which parameters are packed, and the packs' buffers. Built again if
        # a packed parameter's `.data` was replaced by another shape, dtype or device (a grown vocabulary, a cast).
        self._used.add(positions)
        layout = self._layouts.get(positions)
        if layout is None or _signature(layout.packed) != layout.signature:
            packed = [i for i in positions if _packable(self.params[i])]
            rest = [i for i in positions if i not in set(packed)]
            shapes = [self.params[i].shape for i in packed]
            layout = _Layout(
                positions=(*packed, *rest),
                packed=[self.params[i] for i in packed],
                rest=[self.params[i] for i in rest],
                pack=HostPack(shapes + shapes, split=len(shapes)) if packed else None,
                signature=_signature([self.params[i] for i in packed]),
            )
            self._layouts[positions] = layout
        return layout

    def _prune(self) -> None:
        # Keep the layouts (and their packs) of the parameter sets stepped in the window just measured: the set
        # changes whenever a parameter gets no gradient (a skipped block, an expert without tokens), and keeping a
        # pack per set ever seen grew without bound.
        self._layouts = {k: v for k, v in self._layouts.items() if k in self._used}
        kept = {layout.positions for layout in self._layouts.values()}
        self._index_cache = {k: v for k, v in self._index_cache.items() if k in kept}
        self._share_cache = {k: v for k, v in self._share_cache.items() if k in kept}
        self._used = set()

    def _index(self, positions: tuple[int, ...], device: torch.device) -> Tensor:
        # One host-to-device copy per distinct parameter set per run, not per step.
        cached = self._index_cache.get(positions)
        if cached is None or cached.device != device:
            cached = torch.tensor(positions, dtype=torch.long, device=device)
            self._index_cache[positions] = cached
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
        layout = self._layout(tuple(positions))
        weight_parts: list[Tensor] = []
        grad_parts: list[Tensor] = []
        pack = layout.pack
        if pack is not None:
            n = len(layout.packed)
            grads: list[Tensor] = [p.grad for p in layout.packed]  # type: ignore[misc]
            if any(snapshot.pack is pack for snapshot in self._snapshots):
                # A parameter set stepped twice in one window (two optimizers over the same parameters): a second
                # copy, not an overwrite of the first.
                pack = HostPack([p.shape for p in layout.packed] * 2, split=len(layout.packed))
            if all(g.dtype == torch.float32 and g.layout == torch.strided for g in grads):
                squares = pack.load([*layout.packed, *grads]).squares(self.dtype)
                weight_parts.append(squares[:n])
                grad_parts.append(squares[n:])
            else:  # a sparse or differently typed gradient: one by one
                weight_parts.append(pack.load(layout.packed).squares(self.dtype, first=True))
                grad_parts.append(squared_norms(grads, self.dtype))
        local = [local_tensor(p).detach() for p in layout.rest]
        before: list[Tensor] = []
        if local:
            grad_parts.append(squared_norms([p.grad for p in layout.rest], self.dtype))  # type: ignore[misc]
            if self._snapshot_enabled and all(S.reads_on_host(t) for t in local):
                pending = {id(copy) for snapshot in self._snapshots for copy in snapshot.before}
                squares = []
                for position, weight in zip(layout.positions[len(layout.packed) :], local, strict=True):
                    copy = self._host_buffer(position, weight, pending).copy_(weight)
                    squares.append(_host_square(copy))  # right after the copy is written, while it is in cache
                    before.append(copy)
                weight_parts.append(torch.tensor(squares, dtype=self.dtype))
            else:
                weight_parts.append(squared_norms(local, self.dtype))
                if self._snapshot_enabled:
                    before = torch._foreach_mul(local, 1.0)
        device = weight_parts[-1].device
        weight_sq, grad_sq = _joined(weight_parts, device), _joined(grad_parts, device)
        index = self._index(layout.positions, device)
        share = self._share(layout.positions, device)
        if share is not None:
            weight_sq, grad_sq = weight_sq * share, grad_sq * share
        values = torch.stack([weight_sq, grad_sq, torch.zeros_like(weight_sq), torch.ones_like(weight_sq)], dim=1)
        if self._snapshot_enabled:
            self._snapshots.append(_Snapshot(index, layout.packed, pack, local, before, share))
        return index, values

    def _host_buffer(self, position: int, like: Tensor, pending: set[int]) -> Tensor:
        buffer = self._host_buffers.get(position)
        taken = buffer is not None and id(buffer) in pending
        if taken or buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            # A parameter stepped twice in one window (by two optimizers) gets a second copy, not an overwrite.
            buffer = torch.empty_like(like, memory_format=torch.contiguous_format)
            if not taken:
                self._host_buffers[position] = buffer
        return buffer

    @torch.no_grad()
    def after_step(self) -> tuple[Tensor, Tensor] | None:
        """Squared norms of ``w_after - w_before`` for the parameters snapshotted since the last call.

        Returns:
            ``(index, update_sq)`` or ``None`` if nothing was snapshotted. The snapshot is released.
        """
        self._prune()
        if not self._snapshots:
            return None
        indices, updates = [], []
        for snapshot in self._snapshots:
            indices.append(snapshot.index)
            parts = []
            if snapshot.pack is not None:
                parts.append(snapshot.pack.subtract(snapshot.packed).squares(self.dtype, first=True))
            # In place on the copies, which are not read again: no second weight-sized allocation.
            before, current = snapshot.before, snapshot.current
            if before and all(S.reads_on_host(t) for t in before):
                # Each difference is reduced while it is still in cache.
                squares = [_host_square(copy.sub_(weight)) for copy, weight in zip(before, current, strict=True)]
                parts.append(torch.tensor(squares, dtype=self.dtype))
            elif before:
                torch._foreach_sub_(before, current)
                parts.append(squared_norms(before, self.dtype))
            device = snapshot.index.device
            update_sq = _joined(parts, device)
            updates.append(update_sq if snapshot.share is None else update_sq * snapshot.share)
        self._snapshots = []
        return torch.cat(indices), torch.cat(updates)

    def release(self) -> None:
        """Drop any pending snapshot without measuring it, and the copies kept across sampled steps in host memory."""
        self._snapshots = []
        self._host_buffers = {}
        self._used = set()
        self._prune()  # with nothing used: every layout, index and share goes
