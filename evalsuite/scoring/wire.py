"""Plain data across the channel between the checker and the candidate, encoded and decoded without evaluation.

What crosses: None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, nested. Each value is
a JSON array whose first item names its exact type, so the decoder builds only builtin objects: an
always-equal object, an int subclass or anything with a method of the candidate's cannot cross. A message
is a 4-byte big-endian length and a JSON body; json.loads never runs code.

Self-contained on purpose: the checker and the candidate server run this file's text (`python -I -S -c`),
never an import of evalsuite.
"""
import json
import os
import select
import time

MESSAGE_LIMIT = 16 * 1024 * 1024  # bytes of one message: a result larger than this fails the call
DEPTH_LIMIT = 100  # nesting of containers


class WireError(Exception):
    """The channel broke, timed out, or carried something that is not plain data."""


def encode(value, depth=0):
    """`value` as JSON-able tagged arrays; WireError for anything that is not exactly plain data."""
    if depth > DEPTH_LIMIT:
        raise WireError("nested too deep")
    kind = type(value)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", format(value, "x")]  # hex: no digit limit, no float rounding
    if kind is float:
        return ["float", value.hex()]
    if kind is str:
        return ["str", value]
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [encode(item, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    raise WireError(f"a {kind.__name__} is not plain data")


def decode(tagged, depth=0):
    """The inverse of encode, for arrays that came from anyone: builtin objects only, or WireError."""
    if depth > DEPTH_LIMIT:
        raise WireError("nested too deep")
    if type(tagged) is not list or not tagged or type(tagged[0]) is not str:
        raise WireError("not a tagged value")
    tag, body = tagged[0], tagged[1:]
    try:
        if tag == "none" and not body:
            return None
        (payload,) = body
        if tag == "bool" and type(payload) is bool:
            return payload
        if tag == "int" and type(payload) is str:
            return int(payload, 16)
        if tag == "float" and type(payload) is str:
            return float.fromhex(payload)
        if tag == "str" and type(payload) is str:
            return payload
        if tag == "bytes" and type(payload) is str:
            return bytes.fromhex(payload)
        if tag in ("list", "tuple", "set", "frozenset") and type(payload) is list:
            items = [decode(item, depth + 1) for item in payload]
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
        if tag == "dict" and type(payload) is list:
            pairs = []
            for pair in payload:
                if type(pair) is not list or len(pair) != 2:
                    raise WireError("a dict entry is not a pair")
                pairs.append((decode(pair[0], depth + 1), decode(pair[1], depth + 1)))
            return dict(pairs)
    except WireError:
        raise
    except (ValueError, TypeError) as error:  # a malformed number, an unhashable key, a wrong count
        raise WireError(f"malformed {tag}: {error}") from None
    raise WireError(f"unknown or malformed tag {tag!r}")


def send(fd, message):
    """Write one message (a JSON-able value) on `fd`."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MESSAGE_LIMIT:
        raise WireError(f"a message of {len(body)} bytes is over the {MESSAGE_LIMIT}-byte limit")
    data = len(body).to_bytes(4, "big") + body
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd, size, deadline):
    chunks, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise WireError("timed out")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise WireError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd, deadline=None):
    """One message from `fd`, waiting until `deadline` (time.monotonic()) at most; WireError otherwise."""
    size = int.from_bytes(_read_exactly(fd, 4, deadline), "big")
    if size > MESSAGE_LIMIT:
        raise WireError(f"a message of {size} bytes is over the {MESSAGE_LIMIT}-byte limit")
    try:
        return json.loads(_read_exactly(fd, size, deadline))
    except (ValueError, RecursionError) as error:
        raise WireError(f"not JSON: {error}") from None
