"""The heatmap image: colours of every kind of cell, the cell blocks, and PNG bytes that real decoders read back.

The PNG is decoded twice: by a decoder written here from the PNG specification (chunks, CRC-32, zlib, filter type 0),
so the test runs without PIL, and by Pillow where it is installed.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from helpers.png import decode_png

from lightning_hookdiag._heatmap_image import MISSING, NONFINITE, VIRIDIS, ZERO, png_bytes, render


def cells(image: np.ndarray, cell: int) -> list[list[tuple[int, ...]]]:
    """One colour per cell, after checking that every cell is a uniform ``cell x cell`` block."""
    height, width, _ = image.shape
    assert height % cell == 0
    assert width % cell == 0
    out = []
    for r in range(0, height, cell):
        row = []
        for c in range(0, width, cell):
            block = image[r : r + cell, c : c + cell].reshape(-1, 3)
            assert (block == block[0]).all(), f"cell at pixel ({r}, {c}) is not one colour"
            row.append(tuple(int(v) for v in block[0]))
        out.append(row)
    return out


def viridis(index: int) -> tuple[int, ...]:
    return tuple(int(v) for v in VIRIDIS[index])


def test_viridis_table_is_matplotlibs():
    matplotlib = pytest.importorskip("matplotlib")
    expected = np.round(matplotlib.colormaps["viridis"](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)
    assert VIRIDIS.shape == (256, 3)
    assert (expected == VIRIDIS).all()


def test_special_cells_have_their_own_colours_outside_viridis():
    specials = {ZERO, MISSING, NONFINITE}
    assert len(specials) == 3
    table = {tuple(int(v) for v in row) for row in VIRIDIS}
    # Not merely absent: at least 20 (of 255) away in some channel from every viridis colour.
    for colour in specials:
        nearest = min(max(abs(a - b) for a, b in zip(colour, row, strict=True)) for row in table)
        assert nearest >= 20, (colour, nearest)


def test_log_scale_colours_each_kind_of_cell():
    values = [[1.0, 10.0, 100.0], [0.0, None, math.nan], [math.inf, -math.inf, 100.0]]
    image = render(values, scale="log", cell=3)
    assert image.shape == (9, 9, 3)
    assert image.dtype == np.uint8
    # log10: 0, 1, 2 over the range [0, 2] -> indices 0, 127.5 (rounds to 128), 255
    assert cells(image, 3) == [
        [viridis(0), viridis(128), viridis(255)],
        [ZERO, MISSING, NONFINITE],
        [NONFINITE, NONFINITE, viridis(255)],
    ]


def test_linear_scale_keeps_signed_values_and_zero_apart():
    image = render([[-1.0, 0.0, 1.0, 3.0]], scale="linear", cell=1)
    # range [-1, 3]: -1 -> 0, 1 -> (2 / 4) * 255 = 127.5 -> 128, 3 -> 255; 0 is ZERO, not a point of the range
    assert cells(image, 1) == [[viridis(0), ZERO, viridis(128), viridis(255)]]


def test_a_single_value_takes_the_middle_colour():
    assert cells(render([[5.0, 5.0], [None, 5.0]], cell=2), 2) == [
        [viridis(128), viridis(128)],
        [MISSING, viridis(128)],
    ]


def test_values_between_map_to_the_nearest_of_256_colours():
    rng = np.random.default_rng(0)
    values = 10 ** rng.uniform(-6, 3, size=(48, 10))
    image = render(values.tolist(), cell=1)
    logs = np.log10(values)
    expected = np.round((logs - logs.min()) / (logs.max() - logs.min()) * 255).astype(int)
    assert (image == VIRIDIS[expected]).all()


@pytest.mark.parametrize(
    ("values", "kwargs", "match"),
    [
        ([], {}, "at least one row and one column"),
        ([[]], {}, "at least one row and one column"),
        ([[1.0, 2.0], [1.0]], {}, r"same number of columns, got row lengths \[1, 2\]"),
        ([[1.0, -0.5]], {}, r"log scale needs values >= 0, got -0.5 at row 0, column 1; use scale='linear'"),
        ([[1.0]], {"scale": "sqrt"}, "scale must be 'log' or 'linear', got 'sqrt'"),
        ([[1.0]], {"cell": 0}, "cell must be a whole number of pixels >= 1, got 0"),
        ([[1.0]], {"cell": 2.5}, "got 2.5"),
    ],
)
def test_bad_input_is_named(values, kwargs, match):
    with pytest.raises(ValueError, match=match):
        render(values, **kwargs)


def test_png_round_trips_through_an_independent_decoder():
    image = render([[1.0, 0.0, None], [math.nan, 3.0, 9.0]], cell=5)
    assert (decode_png(png_bytes(image)) == image).all()
    assert decode_png(png_bytes(image)).shape == (10, 15, 3)


def test_png_round_trips_through_pillow():
    pil = pytest.importorskip("PIL.Image")
    image = np.random.default_rng(1).integers(0, 256, size=(7, 5, 3), dtype=np.uint8)
    with pil.open(io.BytesIO(png_bytes(image))) as decoded:
        assert decoded.mode == "RGB"
        assert decoded.size == (5, 7)
        assert (np.asarray(decoded) == image).all()


@pytest.mark.parametrize(
    "bad",
    [np.zeros((2, 2, 3), dtype=np.float32), np.zeros((2, 2), dtype=np.uint8), np.zeros((0, 2, 3), dtype=np.uint8)],
)
def test_png_refuses_what_is_not_an_rgb_uint8_image(bad):
    with pytest.raises(ValueError, match="expected an H x W x 3 uint8 image"):
        png_bytes(bad)


def test_png_takes_a_torch_image():
    image = torch.arange(2 * 3 * 3, dtype=torch.uint8).reshape(2, 3, 3)
    assert (decode_png(png_bytes(image)) == image.numpy()).all()
