"""Tensors on the wire: raw little-endian bytes described by (name, dtype, shape), never pickle.

A model travels as one header message listing every tensor, then the concatenated bytes cut into
chunks of a few MiB, then a trailer with the SHA-256 of all the bytes. The receiver knows the exact
size from the header, so it refuses an oversized model before reading any data, holds one buffer of
the model's size, and builds the arrays as zero-copy views into it.

SHA-256 costs about as much CPU as the rest of a transfer, so for a model of `HASH_THREAD_BYTES` or more
both ends hash in a helper thread, overlapped with the transport (hashlib releases the GIL): the sender
hashes the tensors' memory directly (the digest of the concatenated bytes does not depend on the chunk
size), the receiver hashes each filled range of its buffer. Neither keeps an extra copy of any chunk.
"""

from __future__ import annotations

import hashlib
import math
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from fedbroker.errors import Rejection, UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb

CHUNK_BYTES = 2 * 1024 * 1024
INLINE_BYTES = 1024 * 1024  # a model or update this small travels in one unary message (StartTask, UploadWhole)
HASH_THREAD_BYTES = 8 * 1024 * 1024
ALLOWED_DTYPES = frozenset({"float16", "float32", "float64", "int32", "int64", "uint32", "uint64"})  # uint: masked ring data
MAX_TENSORS = 4096
MAX_RANK = 8


def little_endian(array: np.ndarray) -> np.ndarray:
    """The array contiguous and little-endian, as tensors travel: a big-endian host still sends the wire order."""
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))


def tensor_specs(tensors: Mapping[str, np.ndarray]) -> list[pb.TensorSpec]:
    """Name, dtype and shape of each tensor, in order: the header a receiver splits the streamed bytes by."""
    return [pb.TensorSpec(name=name, dtype=arr.dtype.name, shape=list(arr.shape)) for name, arr in tensors.items()]


def iter_chunks(tensors: Mapping[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The concatenated tensor bytes in chunks of exactly `chunk_bytes` (the last may be shorter)."""
    return (bytes(piece) for piece in _chunks([little_endian(arr) for arr in tensors.values()], chunk_bytes))


def _chunks(arrays: list[np.ndarray], chunk_bytes: int) -> Iterator[memoryview | bytes]:
    """Chunks as views of the tensors' memory; only a chunk spanning two tensors is copied together."""
    pending = bytearray()
    for arr in arrays:
        view = arr.data.cast("B") if arr.size else memoryview(b"")
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
            yield view[offset : offset + chunk_bytes]
            offset += chunk_bytes
        pending += view[offset:]
    if pending:
        yield bytes(pending)


class _BackgroundHash:
    """SHA-256 of memory ranges handed over in order, computed in a helper thread.

    The ranges must stay unchanged until `hexdigest` returns (they are views, never copies).
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._ranges: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._abort = False
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (view := self._ranges.get()) is not None:
                if not self._abort:
                    self._digest.update(view)
        except BaseException as exc:  # surfaced by hexdigest
            self._error = exc
            while self._ranges.get() is not None:
                pass

    def update(self, view: memoryview) -> None:
        self._ranges.put(view)

    def hexdigest(self) -> str:
        self.close()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()

    def close(self, *, abort: bool = False) -> None:
        if self._thread.is_alive():
            self._abort = abort
            self._ranges.put(None)
            self._thread.join()


def tensors_sha256(tensors: Mapping[str, np.ndarray]) -> str:
    """The SHA-256 that a stream of `tensors` carries in its trailer (it does not depend on the chunk size)."""
    sha = hashlib.sha256()
    for arr in tensors.values():
        arr = little_endian(arr)
        if arr.size:
            sha.update(arr.data.cast("B"))
    return sha.hexdigest()


def _hashed_chunks(tensors: Mapping[str, np.ndarray], chunk_bytes: int, digest: list[str],
                   known: Callable[[], str] | None = None) -> Iterator[memoryview | bytes]:
    """The chunks to send; once they are all out, appends the SHA-256 of their bytes to `digest`.

    `known` gives that digest instead (hashed elsewhere, e.g. once for every download of a global model):
    it is called after the last chunk, so it may wait for a hash that runs meanwhile.
    """
    arrays = [little_endian(arr) for arr in tensors.values()]
    if known is not None:
        yield from _chunks(arrays, chunk_bytes)
        digest.append(known())
        return
    hasher = _BackgroundHash() if sum(arr.nbytes for arr in arrays) >= HASH_THREAD_BYTES else None
    sha = hashlib.sha256()
    try:
        if hasher is not None:
            for arr in arrays:
                if arr.size:
                    hasher.update(arr.data.cast("B"))
        for piece in _chunks(arrays, chunk_bytes):
            if hasher is None:
                sha.update(piece)
            yield piece
        digest.append(hasher.hexdigest() if hasher is not None else sha.hexdigest())
    finally:
        if hasher is not None:
            hasher.close(abort=True)  # a no-op after hexdigest; on a cancelled stream, stop hashing at once


def stream_messages(
    message_cls: Callable[..., Any], header: Any, tensors: Mapping[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[Any]:
    """header → data chunks → trailer, wrapped in `message_cls` (UpdateChunk or ModelChunk)."""
    yield message_cls(header=header)
    digest: list[str] = []
    for piece in _hashed_chunks(tensors, chunk_bytes, digest):
        yield message_cls(data=bytes(piece))
    yield message_cls(trailer=pb.Trailer(sha256=digest[0]))


# ----- the same streams as serialized bytes (clients that skip protobuf objects for data chunks) -----
#
# UpdateChunk and ModelChunk carry `bytes data = 2` in their oneof, so a data chunk on the wire is the
# tag 0x12 (field 2, length-delimited), the length as a varint, then the bytes: framing it by hand
# copies a chunk once (tensor memory → message bytes) where a protobuf object costs three copies (into a
# bytes, into the message, out by SerializeToString), and reading it by hand hands out a view of the
# received bytes where parsing copies twice (into the message, out by `.data`).

DATA_TAG = 0x12
for _cls in (pb.UpdateChunk, pb.ModelChunk):
    _field = _cls.DESCRIPTOR.fields_by_name["data"]
    if (_field.number, _field.type) != (2, _field.TYPE_BYTES):  # the proto changed: fix DATA_TAG with it
        raise ImportError(f"{_cls.__name__}.data is no longer field 2 of type bytes; codec.DATA_TAG is stale")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encoded_stream(
    message_cls: Callable[..., Any], header: Any, tensors: Mapping[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES,
    *, sha256: Callable[[], str] | None = None,
) -> Iterator[bytes]:
    """`stream_messages`, serialized: byte for byte what SerializeToString gives for each message.

    `sha256`: gives the digest of the tensors' bytes, computed elsewhere (see `_hashed_chunks`); None hashes
    them here.
    """
    yield message_cls(header=header).SerializeToString()
    digest: list[str] = []
    tag = bytes((DATA_TAG,))
    for piece in _hashed_chunks(tensors, chunk_bytes, digest, sha256):
        yield b"".join((tag, _varint(len(piece)), piece))
    yield message_cls(trailer=pb.Trailer(sha256=digest[0])).SerializeToString()


class _DataPart:
    """A received data chunk as a view of the message bytes; quacks like a message whose part is data."""

    __slots__ = ("data",)

    def __init__(self, data: memoryview) -> None:
        self.data = data

    def WhichOneof(self, _: str) -> str:
        return "data"


def joined(tensors: Mapping[str, np.ndarray]) -> bytes:
    """The tensors' bytes in one piece: the payload of a one-message transfer (its digest is
    `tensors_sha256`, the same as a stream's)."""
    return b"".join(little_endian(arr).tobytes() for arr in tensors.values())


def as_stream(message_cls: Callable[..., Any], header: Any, data: bytes, sha256: str) -> Iterator[Any]:
    """A one-message transfer read as the stream it stands for (header → its bytes as one chunk → trailer),
    so that it meets every check a streamed transfer meets (`receive`)."""
    yield message_cls(header=header)
    if data:
        yield _DataPart(memoryview(data))
    yield message_cls(trailer=pb.Trailer(sha256=sha256))


def decoded_stream(raw: Iterable[bytes], message_cls: Any) -> Iterator[Any]:
    """Serialized messages → what `receive` reads: data chunks as views, anything else parsed in full."""
    for blob in raw:
        if blob[:1] == b"\x12":
            length, shift, pos = 0, 0, 1
            while pos < len(blob) and pos <= 10:
                byte = blob[pos]
                length |= (byte & 0x7F) << shift
                shift += 7
                pos += 1
                if not byte & 0x80:
                    break
            if pos + length == len(blob):  # exactly one data field: the only shape senders produce
                yield _DataPart(memoryview(blob)[pos:])
                continue
        yield message_cls.FromString(blob)


def expected_bytes(specs: Iterable[pb.TensorSpec], *, max_bytes: int) -> int:
    """Validate tensor headers and return the byte count they announce."""
    total = 0
    names: set[str] = set()
    specs = list(specs)
    if not specs:
        raise UploadRejected(Rejection.MALFORMED_STREAM, "the header lists no tensors")
    if len(specs) > MAX_TENSORS:
        raise UploadRejected(Rejection.MALFORMED_STREAM, f"the header lists {len(specs)} tensors, more than {MAX_TENSORS}")
    for spec in specs:
        if not spec.name or spec.name in names:
            raise UploadRejected(Rejection.MALFORMED_STREAM, f"tensor name {spec.name!r} is empty or repeated")
        names.add(spec.name)
        if spec.dtype not in ALLOWED_DTYPES:
            raise UploadRejected(
                Rejection.WRONG_DTYPE, f"tensor {spec.name!r}: dtype {spec.dtype!r} is not one of {sorted(ALLOWED_DTYPES)}"
            )
        if len(spec.shape) > MAX_RANK or any(d < 0 for d in spec.shape):
            raise UploadRejected(Rejection.WRONG_SHAPE, f"tensor {spec.name!r}: shape {list(spec.shape)} is not a valid shape")
        count = 1
        for d in spec.shape:
            count *= d
            if count * 8 > max_bytes:
                break
        if count == 0 and math.prod(d for d in spec.shape if d) > max_bytes:  # numpy cannot even shape it
            raise UploadRejected(Rejection.WRONG_SHAPE, f"tensor {spec.name!r}: shape {list(spec.shape)} is empty but has "
                                                f"dimensions beyond the {max_bytes}-byte limit")
        total += count * np.dtype(spec.dtype).itemsize
        if total > max_bytes:
            raise UploadRejected(Rejection.TOO_LARGE, f"the model announces more than the {max_bytes}-byte limit")
    return total


def receive(messages: Iterable[Any], *, max_bytes: int) -> tuple[Any, dict[str, np.ndarray], str]:
    """Read header → chunks → trailer; return (header, tensors, sha256) or raise UploadRejected naming the fault."""
    stream = iter(messages)
    header, total = receive_header(stream, max_bytes=max_bytes)
    tensors, digest = receive_payload(stream, header, total)
    return header, tensors, digest


def receive_header(messages: Iterator[Any], *, max_bytes: int) -> tuple[Any, int]:
    """Read the header alone and return it with the byte count it announces.

    Nothing else of the stream is read, so a receiver can refuse an unknown worker or a wrong shape before
    any payload arrives, and choose the buffer that `receive_payload` fills.
    """
    first = next(messages, None)
    if first is None or first.WhichOneof("part") != "header":
        raise UploadRejected(Rejection.MALFORMED_STREAM, "the stream must start with a header message")
    header = first.header
    return header, expected_bytes(header.tensors, max_bytes=max_bytes)


def receive_payload(messages: Iterator[Any], header: Any, total: int, *,
                    buffer: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], str]:
    """Read the rest of a stream after its header: (tensors as views of the buffer, sha256).

    `buffer`: the `total` contiguous uint8 bytes to receive into (the aggregation service passes a row of
    its running mean); by default a new one.
    """
    if buffer is None:
        buffer = np.empty(total, dtype=np.uint8)  # not bytearray(total): zero-filling 400 MB cost 14% of an upload
    elif buffer.dtype != np.uint8 or buffer.shape != (total,) or not buffer.flags.c_contiguous:
        raise ValueError(f"the receive buffer must be {total} contiguous bytes, got {buffer.dtype} {buffer.shape}")
    view = buffer.data
    hasher = _BackgroundHash() if total >= HASH_THREAD_BYTES else None
    sha = hashlib.sha256()
    filled = 0
    trailer = None
    try:
        for message in messages:
            part = message.WhichOneof("part")
            if trailer is not None:
                raise UploadRejected(Rejection.MALFORMED_STREAM, "a message arrived after the trailer")
            if part == "data":
                data = message.data
                end = filled + len(data)
                if end > total:
                    raise UploadRejected(
                        Rejection.TOO_LARGE, f"the stream carries more than the {total} bytes its header announced"
                    )
                view[filled:end] = data
                if hasher is not None:
                    hasher.update(view[filled:end])
                else:
                    sha.update(data)
                filled = end
            elif part == "trailer":
                trailer = message.trailer
            else:
                raise UploadRejected(Rejection.MALFORMED_STREAM, f"unexpected {part or 'empty'} message inside the stream")
        if trailer is None or filled != total:
            raise UploadRejected(Rejection.TRUNCATED, f"the stream ended after {filled} of {total} bytes (no trailer)"
                                 if trailer is None else f"the stream ended after {filled} of {total} bytes")
        digest = hasher.hexdigest() if hasher is not None else sha.hexdigest()
    finally:
        if hasher is not None:
            hasher.close(abort=True)  # a no-op after hexdigest; on an error, stop hashing at once
    if trailer.sha256 != digest:
        raise UploadRejected(Rejection.DIGEST_MISMATCH, "the SHA-256 in the trailer does not match the bytes received")
    return decode(header.tensors, buffer), trailer.sha256


def decode(specs: Iterable[pb.TensorSpec], buffer: bytearray | np.ndarray) -> dict[str, np.ndarray]:
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

