"""The heatmap as pixels, for the loggers: a layers x steps matrix to an RGB array and to PNG bytes, without matplotlib.

Rows are layers in forward order (shallow at top), columns sampled steps, one colour per cell, each cell a block of
at least ``cell`` pixels. The image is the matrix alone: no labels or legend (the logger shows the tag, and the
report's :mod:`~lightning_hookdiag.report._plot` draws the labelled figure). Finite non-zero values run through
viridis; zero (a dead layer, a vanished gradient), a missing value (``None``: not logged) and a non-finite value
(NaN or +/-Inf: a statistic that broke) each have their own colour outside viridis, so none reads as a small value.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

__all__ = ["MISSING", "NONFINITE", "VIRIDIS", "ZERO", "as_rgb", "png_bytes", "render"]

# matplotlib's viridis (Stefan van der Walt and Nathaniel Smith, CC0; matplotlib/_cm_listed.py ``_viridis_data``)
# sampled at 256 points and rounded to 8 bits, as RRGGBB hex; tests/unit/test_heatmap_image.py checks it against
# matplotlib where installed.
_VIRIDIS_HEX = (
    "44015444025645045745055946075a46085c460a5d460b5e470d60470e6147106347116447136548146748166848176948186a481a6c"
    "481b6d481c6e481d6f481f70482071482173482374482475482576482677482878482979472a7a472c7a472d7b472e7c472f7d46307e"
    "46327e46337f463480453581453781453882443983443a83443b84433d84433e85423f85424086424186414287414487404588404688"
    "3f47883f48893e49893e4a893e4c8a3d4d8a3d4e8a3c4f8a3c508b3b518b3b528b3a538b3a548c39558c39568c38588c38598c375a8c"
    "375b8d365c8d365d8d355e8d355f8d34608d34618d33628d33638d32648e32658e31668e31678e31688e30698e306a8e2f6b8e2f6c8e"
    "2e6d8e2e6e8e2e6f8e2d708e2d718e2c718e2c728e2c738e2b748e2b758e2a768e2a778e2a788e29798e297a8e297b8e287c8e287d8e"
    "277e8e277f8e27808e26818e26828e26828e25838e25848e25858e24868e24878e23888e23898e238a8d228b8d228c8d228d8d218e8d"
    "218f8d21908d21918c20928c20928c20938c1f948c1f958b1f968b1f978b1f988b1f998a1f9a8a1e9b8a1e9c891e9d891f9e891f9f88"
    "1fa0881fa1881fa1871fa28720a38620a48621a58521a68522a78522a88423a98324aa8325ab8225ac8226ad8127ad8128ae8029af7f"
    "2ab07f2cb17e2db27d2eb37c2fb47c31b57b32b67a34b67935b77937b87838b9773aba763bbb753dbc743fbc7340bd7242be7144bf70"
    "46c06f48c16e4ac16d4cc26c4ec36b50c46a52c56954c56856c66758c7655ac8645cc8635ec96260ca6063cb5f65cb5e67cc5c69cd5b"
    "6ccd5a6ece5870cf5773d05675d05477d1537ad1517cd2507fd34e81d34d84d44b86d54989d5488bd6468ed64590d74393d74195d840"
    "98d83e9bd93c9dd93ba0da39a2da37a5db36a8db34aadc32addc30b0dd2fb2dd2db5de2bb8de29bade28bddf26c0df25c2df23c5e021"
    "c8e020cae11fcde11dd0e11cd2e21bd5e21ad8e219dae319dde318dfe318e2e418e5e419e7e419eae51aece51befe51cf1e51df4e61e"
    "f6e620f8e621fbe723fde725"
)
VIRIDIS: np.ndarray = np.frombuffer(bytes.fromhex(_VIRIDIS_HEX), dtype=np.uint8).reshape(256, 3)
"""The 256 x 3 ``uint8`` colour table of finite non-zero values, smallest first."""

ZERO = (0, 0, 0)  # black: darker than viridis' darkest purple
MISSING = (211, 211, 211)  # light grey: not logged
NONFINITE = (228, 26, 28)  # red: no viridis colour is near it

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _as_matrix(values: Sequence[Sequence[float | None]]) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as a float64 matrix (``None`` as NaN) and the mask of its ``None`` cells; checks the shape."""
    rows = [list(row) for row in values]
    if not rows or not rows[0]:
        raise ValueError(f"a heatmap needs at least one row and one column, got {len(rows)} row(s)")
    widths = {len(row) for row in rows}
    if len(widths) > 1:
        raise ValueError(f"every row needs the same number of columns, got row lengths {sorted(widths)}")
    missing = np.array([[v is None for v in row] for row in rows], dtype=bool)
    data = np.array([[math.nan if v is None else float(v) for v in row] for row in rows], dtype=np.float64)
    return data, missing


def _colour_index(scaled: np.ndarray) -> np.ndarray:
    """The viridis index (0..255) of each of ``scaled``, from its smallest (0) to its largest (255)."""
    low, high = float(scaled.min()), float(scaled.max())
    if high == low:  # one value: the middle of the map, so it reads as neither small nor large
        return np.full(scaled.shape, 128, dtype=np.int64)
    return np.round((scaled - low) / (high - low) * 255).astype(np.int64)


def render(
    values: Sequence[Sequence[float | None]], *, scale: Literal["log", "linear"] = "log", cell: int = 8
) -> np.ndarray:
    """The heatmap of ``values`` (rows: layers in forward order, columns: sampled steps) as an RGB image.

    Args:
        values: One row per layer, one value per sampled step; ``None`` where the value was not logged.
        scale: ``"log"`` (norms, ratios: orders of magnitude) colours by ``log10(value)``, ``"linear"`` by value.
            The colour range runs from the smallest to the largest finite non-zero value.
        cell: Side of a cell in pixels, at least 1.

    Returns:
        An ``(rows * cell, columns * cell, 3)`` ``uint8`` array.

    Raises:
        ValueError: If ``values`` is empty or ragged, ``scale`` or ``cell`` is invalid, or a log scale meets a
            negative value.

    Example:
        >>> image = render([[1.0, 10.0], [0.0, None]], cell=2)
        >>> image.shape, image.dtype
        ((4, 4, 3), dtype('uint8'))
        >>> image[::2, ::2].tolist()  # one pixel per cell: 1 (viridis' first colour), 10 (its last), 0, None
        [[[68, 1, 84], [253, 231, 37]], [[0, 0, 0], [211, 211, 211]]]
    """
    if scale not in ("log", "linear"):
        raise ValueError(f"scale must be 'log' or 'linear', got {scale!r}")
    if isinstance(cell, bool) or not isinstance(cell, int) or cell < 1:
        raise ValueError(f"cell must be a whole number of pixels >= 1, got {cell!r}")
    data, missing = _as_matrix(values)
    finite = np.isfinite(data)
    coloured = finite & (data != 0)
    if scale == "log" and (data[finite] < 0).any():
        row, column = (int(i) for i in np.argwhere(finite & (data < 0))[0])
        raise ValueError(
            f"a log scale needs values >= 0, got {float(data[row, column])!r} at row {row}, column {column}; "
            "use scale='linear' for signed statistics"
        )
    image = np.empty((*data.shape, 3), dtype=np.uint8)
    image[finite & (data == 0)] = ZERO
    image[~finite] = NONFINITE
    image[missing] = MISSING
    if coloured.any():
        picked = data[coloured]
        scaled = np.log10(picked) if scale == "log" else picked
        image[coloured] = VIRIDIS[_colour_index(scaled)]
    return np.repeat(np.repeat(image, cell, axis=0), cell, axis=1)


def _chunk(kind: bytes, payload: bytes) -> bytes:
    """One PNG chunk: length, type, payload, CRC-32 of type and payload."""
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def as_rgb(image: Any) -> np.ndarray:
    """``image`` (a numpy array or a torch tensor, on any device) as an ``H x W x 3`` ``uint8`` numpy array.

    Raises:
        ValueError: If ``image`` is not an ``H x W x 3`` ``uint8`` array with ``H, W >= 1``.
    """
    if hasattr(image, "detach"):  # a torch tensor, without importing torch here
        image = image.detach().cpu().numpy()
    pixels = np.asarray(image)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3 or 0 in pixels.shape:
        raise ValueError(f"expected an H x W x 3 uint8 image, got shape {pixels.shape} and dtype {pixels.dtype}")
    return pixels


def png_bytes(image: Any) -> bytes:
    """``image`` (see :func:`as_rgb`) as an 8-bit RGB PNG file, written with ``zlib`` alone."""
    pixels = as_rgb(image)
    height, width, _ = pixels.shape
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no filter, no interlace
    rows = np.concatenate([np.zeros((height, 1), dtype=np.uint8), pixels.reshape(height, width * 3)], axis=1)
    return (
        _PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(np.ascontiguousarray(rows).tobytes(), 6))
        + _chunk(b"IEND", b"")
    )
