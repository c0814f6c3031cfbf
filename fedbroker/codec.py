"""Tensors on the wire: raw little-endian bytes described by (name, dtype, shape), never pickle.

A model travels as one header message listing every tensor, then the concatenated bytes cut into
chunks of a few MiB, then a trailer with the SHA-256 of all the bytes. The receiver knows the exact
size from the header, so it refuses an oversized model before reading any data, holds one buffer of
the model's size, and builds the arrays as zero-copy views into it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from fedbroker.errors import UploadRejected
from proto import fedbroker_pb2 as pb

CHUNK_BYTES = 2 * 1024 * 1024
ALLOWED_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64"})
MAX_TENSORS = 4096
MAX_RANK = 8


def little_endian(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def tensor_specs(tensors: Mapping[str, np.ndarray]) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=name, dtype=arr.dtype.name, shape=list(arr.shape)) for name, arr in tensors.items()]


def iter_chunks(tensors: Mapping[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The concatenated tensor bytes in chunks of exactly `chunk_bytes` (the last may be shorter)."""
    pending = bytearray()
    for arr in tensors.values():
        view = memoryview(little_endian(arr)).cast("B")
        offset = 0
        if pending:
            take = min(chunk_bytes - len(pending), len(view))
            pending += view[:take]
            offset = take
            if len(pending) < chunk_bytes:
                continue
            yield bytes(pending)
            pending = bytearray()
        while len(view) - offset >= chunk_bytes:
            yield bytes(view[offset : offset + chunk_bytes])
            offset += chunk_bytes
        pending += view[offset:]
    if pending:
        yield bytes(pending)


def stream_messages(
    message_cls: Callable[..., Any], header: Any, tensors: Mapping[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[Any]:
    """header → data chunks → trailer, wrapped in `message_cls` (UpdateChunk or ModelChunk)."""
    yield message_cls(header=header)
    digest = hashlib.sha256()
    for piece in iter_chunks(tensors, chunk_bytes):
        digest.update(piece)
        yield message_cls(data=piece)
    yield message_cls(trailer=pb.Trailer(sha256=digest.hexdigest()))


def expected_bytes(specs: Iterable[pb.TensorSpec], *, max_bytes: int) -> int:
    """Validate tensor headers and return the byte count they announce."""
    total = 0
    names: set[str] = set()
    specs = list(specs)
    if not specs:
        raise UploadRejected("malformed_stream", "the header lists no tensors")
    if len(specs) > MAX_TENSORS:
        raise UploadRejected("malformed_stream", f"the header lists {len(specs)} tensors, more than {MAX_TENSORS}")
    for spec in specs:
        if not spec.name or spec.name in names:
            raise UploadRejected("malformed_stream", f"tensor name {spec.name!r} is empty or repeated")
        names.add(spec.name)
        if spec.dtype not in ALLOWED_DTYPES:
            raise UploadRejected(
                "wrong_dtype", f"tensor {spec.name!r}: dtype {spec.dtype!r} is not one of {sorted(ALLOWED_DTYPES)}"
            )
        if len(spec.shape) > MAX_RANK or any(d < 0 for d in spec.shape):
            raise UploadRejected("wrong_shape", f"tensor {spec.name!r}: shape {list(spec.shape)} is not a valid shape")
        count = 1
        for d in spec.shape:
            count *= d
            if count * 8 > max_bytes:
                break
        total += count * np.dtype(spec.dtype).itemsize
        if total > max_bytes:
            raise UploadRejected("too_large", f"the model announces more than the {max_bytes}-byte limit")
    return total


def receive(
    messages: Iterable[Any], *, max_bytes: int, on_header: Callable[[Any], None] | None = None
) -> tuple[Any, dict[str, np.ndarray], str]:
    """Read header → chunks → trailer; return (header, tensors, sha256) or raise UploadRejected naming the fault.

    `on_header` sees the header before any data is read, so an unknown worker or a wrong shape is refused
    without receiving the payload.
    """
    iterator = iter(messages)
    first = next(iterator, None)
    if first is None or first.WhichOneof("part") != "header":
        raise UploadRejected("malformed_stream", "the stream must start with a header message")
    header = first.header
    total = expected_bytes(header.tensors, max_bytes=max_bytes)
    if on_header is not None:
        on_header(header)
    buffer = bytearray(total)
    filled = 0
    digest = hashlib.sha256()
    trailer = None
    for message in iterator:
        part = message.WhichOneof("part")
        if trailer is not None:
            raise UploadRejected("malformed_stream", "a message arrived after the trailer")
        if part == "data":
            data = message.data
            if filled + len(data) > total:
                raise UploadRejected(
                    "too_large", f"the stream carries more than the {total} bytes its header announced"
                )
            buffer[filled : filled + len(data)] = data
            filled += len(data)
            digest.update(data)
        elif part == "trailer":
            trailer = message.trailer
        else:
            raise UploadRejected("malformed_stream", f"unexpected {part or 'empty'} message inside the stream")
    if trailer is None or filled != total:
        raise UploadRejected("truncated", f"the stream ended after {filled} of {total} bytes (no trailer)"
                             if trailer is None else f"the stream ended after {filled} of {total} bytes")
    if trailer.sha256 != digest.hexdigest():
        raise UploadRejected("digest_mismatch", "the SHA-256 in the trailer does not match the bytes received")
    return header, decode(header.tensors, buffer), trailer.sha256


def decode(specs: Iterable[pb.TensorSpec], buffer: bytearray) -> dict[str, np.ndarray]:
    """Zero-copy views into `buffer`, one per spec, in native byte order."""
    tensors: dict[str, np.ndarray] = {}
    offset = 0
    for spec in specs:
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        count = int(np.prod(spec.shape, dtype=np.int64))
        arr = np.frombuffer(buffer, dtype=dtype, count=count, offset=offset).reshape(tuple(spec.shape))
        offset += count * dtype.itemsize
        tensors[spec.name] = arr if dtype.isnative else arr.astype(dtype.newbyteorder("="))
    return tensors

