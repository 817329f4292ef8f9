"""Offline W&B: a logger whose run stays on disk, its end, and the run file's records read back without W&B."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest


def offline_wandb_logger(save_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``WandbLogger`` writing an offline run under ``save_dir``, with W&B's own folders there too, quietly.

    End it with :func:`finish_wandb` before reading the run's files.
    """
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(save_dir / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings = wandb.Settings(
        disable_git=True, disable_code=True, console="off", x_disable_stats=True, x_disable_meta=True
    )
    return WandbLogger(save_dir=str(save_dir), offline=True, project="hookdiag", settings=settings)


def finish_wandb() -> None:
    """End the W&B run and wait until its file is written: offline, ``finish()`` can return before the service
    process has written it; ``teardown()`` waits for the service to shut down (it starts again on the next init)."""
    import wandb

    wandb.finish()
    wandb.teardown()


_WANDB_BLOCK = 32 * 1024
_WANDB_HEADER = 7  # b":W&B", magic 0xBEE1 (2 bytes), version (1 byte)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_wandb_records(path: Path) -> list[bytes]:
    """The serialized ``Record`` protobufs of an offline ``run-<id>.wandb`` file.

    The file is a LevelDB-style log: 32 KiB blocks of chunks, each with a 7-byte header (CRC32C, little-endian
    length, type); a record too long for the rest of a block is split into FIRST/MIDDLE/LAST chunks.
    """
    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    records: list[bytes] = []
    pending = b""
    pos = _WANDB_HEADER
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # block trailer: zero padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            records.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            records.append(pending + chunk)
        else:  # zero-filled tail of a preallocated block
            break
    return records
