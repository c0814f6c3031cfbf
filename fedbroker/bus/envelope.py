"""Control messages on the bus are protobuf Envelopes; a body that does not parse is refused by name."""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from fedbroker.errors import FedbrokerError
from fedbroker.proto import fedbroker_pb2 as pb


class MalformedMessage(FedbrokerError):
    """A bus body that is no Envelope, or holds another message than expected: poison, dead-lettered at once."""

    reason = "malformed_message"


def decode(body: bytes, *, expect: tuple[str, ...]) -> pb.Envelope:
    """The Envelope in `body`, holding one of the `expect`ed messages: a consumer never reads a message meant
    for another."""
    envelope = pb.Envelope()
    try:
        envelope.ParseFromString(body)
    except DecodeError as exc:
        raise MalformedMessage(f"message body of {len(body)} bytes is not a fedbroker Envelope: {exc}") from exc
    kind = envelope.WhichOneof("message")
    if kind not in expect:
        raise MalformedMessage(f"expected one of {', '.join(expect)}, got {kind or 'an empty envelope'}")
    return envelope


def encode(**message: Message) -> bytes:
    """One message in its Envelope, named by its field: `encode(heartbeat=pb.Heartbeat(...))`."""
    if len(message) != 1:
        raise TypeError(f"an envelope holds exactly one message, got {len(message)}")
    ((kind, body),) = message.items()
    envelope = pb.Envelope()
    getattr(envelope, kind).CopyFrom(body)
    return envelope.SerializeToString()
