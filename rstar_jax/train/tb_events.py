"""TensorBoard event files for scalars, written without a TensorBoard library.

A run logs only scalars, and the writers that exist import heavy frameworks to do it (tensorboardX
imports torch whenever torch is installed: seconds of start-up and hundreds of MB in every launch and
evaluation process). The format is small and stable, so it is written here:

- a file `events.out.tfevents.<seconds>.<host>.<pid>` of TFRecords: each record is the payload's
  length (u64, little-endian), the masked CRC-32C of those 8 bytes (u32), the payload, and the
  payload's masked CRC-32C (u32);
- each payload a serialized `tensorflow.Event` protocol buffer: `wall_time` (field 1, double),
  `step` (2, int64; either left out when 0), then `file_version` (3, string) in the first record, or a `Summary` (5) whose
  `Value`s (1) each hold a `tag` (1, string) and a `simple_value` (2, float), as TensorBoard's
  scalar dashboard reads them.
"""

from __future__ import annotations

import os
import pathlib
import socket
import struct
import time
from collections.abc import Iterable

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: the CRC rotated right by 15 bits plus a constant, so that a CRC of
    bytes that themselves hold CRCs is not trivially related to them."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 fields encode negatives as ten-byte two's complement
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int, *, file_version: str | None = None,
                scalars: Iterable[tuple[str, float]] = ()) -> bytes:
    """One serialized `Event`: the file's version record, or the scalars of a step."""
    # Fields at their default (0) are left out, as protocol buffers serialize them.
    head = (b"\x09" + struct.pack("<d", wall_time) if wall_time else b"") + (b"\x10" + _varint(int(step)) if step else b"")
    if file_version is not None:
        return head + _bytes_field(3, file_version.encode())
    values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                      for tag, value in scalars)
    return head + _bytes_field(5, values)


def record_bytes(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", masked_crc32c(length)) + payload + struct.pack("<I", masked_crc32c(payload))


class ScalarEventWriter:
    """Appends one event per `add_scalars` call to a new event file in `logdir`; every call reaches
    the operating system before it returns, so a killed run keeps the steps it logged."""

    def __init__(self, logdir: str | pathlib.Path):
        self.logdir = pathlib.Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.logdir / f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}"
        self._file = open(self.path, "ab")
        self._file.write(record_bytes(event_bytes(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def add_scalars(self, step: int, scalars: Iterable[tuple[str, float]]) -> None:
        scalars = list(scalars)
        if scalars:
            self._file.write(record_bytes(event_bytes(time.time(), step, scalars=scalars)))
            self._file.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        self._file.close()
