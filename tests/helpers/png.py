"""A PNG decoder written from the PNG specification (chunks, CRC-32, zlib, filter type 0), so that tests read the
package's images back without PIL."""

from __future__ import annotations

import struct
import zlib

import numpy as np


def decode_png(data: bytes) -> np.ndarray:
    """An 8-bit RGB, non-interlaced PNG whose rows all use filter type 0, as an ``H x W x 3`` array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, payload = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + payload), f"bad CRC in {kind!r}"
        chunks.append((kind, payload))
        pos += 12 + length
    assert [k for k, _ in chunks][0] == b"IHDR"
    assert chunks[-1][0] == b"IEND"
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour, compression, filtering, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(p for k, p in chunks if k == b"IDAT"))
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + width * 3)
    assert (rows[:, 0] == 0).all(), "filter types other than 0 are not decoded here"
    return rows[:, 1:].reshape(height, width, 3)
