"""Control messages on the bus are protobuf Envelopes; a body that does not parse is refused by name."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from fedbroker.errors import FedbrokerError
from fedbroker.proto import fedbroker_pb2 as pb


class MalformedMessage(FedbrokerError):
    reason = "malformed_message"


def decode(body: bytes, *, expect: tuple[str, ...]) -> pb.Envelope:
    envelope = pb.Envelope()
    try:
        envelope.ParseFromString(body)
    except DecodeError as exc:
        raise MalformedMessage(f"message body of {len(body)} bytes is not a fedbroker Envelope: {exc}") from exc
    kind = envelope.WhichOneof("message")
    if kind not in expect:
        raise MalformedMessage(f"expected one of {', '.join(expect)}, got {kind or 'an empty envelope'}")
    return envelope


def encode(**message: object) -> bytes:
    return pb.Envelope(**message).SerializeToString()
