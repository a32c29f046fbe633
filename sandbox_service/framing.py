"""Length-prefixed frames between the server and its workers: a JSON header plus raw byte blobs.

Frame = u32 body length | u32 header length | header (JSON, with "blobs": [lengths]) | blobs.
Raw blobs keep program output byte-exact (non-UTF-8 included) without base64.
"""

from __future__ import annotations

import json
import struct

MAX_FRAME = 256 << 20
_U32 = struct.Struct(">I")


def encode(header: dict, blobs: tuple[bytes, ...] | list[bytes] = ()) -> bytes:
    head = json.dumps({**header, "blobs": [len(b) for b in blobs]}, separators=(",", ":")).encode()
    body_len = 4 + len(head) + sum(len(b) for b in blobs)
    return b"".join([_U32.pack(body_len), _U32.pack(len(head)), head, *blobs])


def decode_body(body: bytes | memoryview) -> tuple[dict, list[bytes]]:
    body = memoryview(body)
    (head_len,) = _U32.unpack(body[:4])
    header = json.loads(bytes(body[4:4 + head_len]))
    blobs, pos = [], 4 + head_len
    for n in header.pop("blobs", []):
        blobs.append(bytes(body[pos:pos + n]))
        pos += n
    if pos != len(body):
        raise ValueError(f"frame: {len(body) - pos} trailing bytes")
    return header, blobs


class FrameBuffer:
    """Incremental decoder for a byte stream (the worker's non-blocking socket)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict, list[bytes]]]:
        self._buf += data
        frames = []
        while len(self._buf) >= 4:
            (n,) = _U32.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
            if len(self._buf) < 4 + n:
                break
            frames.append(decode_body(bytes(self._buf[4:4 + n])))
            del self._buf[:4 + n]
        return frames


async def read_frame(reader) -> tuple[dict, list[bytes]]:
    """Reads one frame from an asyncio.StreamReader (raises IncompleteReadError at EOF)."""
    (n,) = _U32.unpack(await reader.readexactly(4))
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return decode_body(await reader.readexactly(n))
