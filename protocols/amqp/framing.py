"""Is this byte string a whole AMQP 1.0 message? Checked before proton decodes it.

Why: proton's `Message.decode` accepts truncated or garbage bytes and returns an empty
message, which would store a message the client never sent. This walks the encoding (every
constructor's width follows from its code, AMQP 1.0 §1.6.1) without building values.
"""

from __future__ import annotations

import struct

# section descriptors, header (0x70) ... footer (0x78), as smallulong / ulong codes or symbols
SECTION_CODES = range(0x70, 0x79)
SECTION_NAMES = {
    "amqp:header:list": 0x70,
    "amqp:delivery-annotations:map": 0x71,
    "amqp:message-annotations:map": 0x72,
    "amqp:properties:list": 0x73,
    "amqp:application-properties:map": 0x74,
    "amqp:data:binary": 0x75,
    "amqp:amqp-sequence:list": 0x76,
    "amqp:amqp-value:*": 0x77,
    "amqp:footer:map": 0x78,
}
MESSAGE_ANNOTATIONS, PROPERTIES, FOOTER = 0x72, 0x73, 0x78
BODY_CODES = range(0x75, 0x78)  # data, amqp-sequence, amqp-value
REPEATABLE = (0x75, 0x76)  # a body may be several data or several amqp-sequence sections

_U32 = struct.Struct(">I").unpack_from
_FIXED_WIDTH = {0x4: 0, 0x5: 1, 0x6: 2, 0x7: 4, 0x8: 8, 0x9: 16}
MAX_DEPTH = 64  # nesting of described / compound values
# str8, str32, sym8, sym32: proton hands them on unchecked, and reading one that is not
# UTF-8 raises in its Python binding
_TEXT_CODES = (0xA1, 0xB1, 0xA3, 0xB3)


# Values a message may hold (every element of its lists and maps counts): proton's decoder
# and the JSON copy MQTT subscribers get build an object for each on the event loop, and one
# amqp-value list of 14 million nulls held the node, every client with it, for 8 s.
MAX_VALUES = 65_536


class Malformed(ValueError):
    """Not a complete, well-formed AMQP message encoding."""


class OverLimit(ValueError):
    """Well-formed, but more values than the gateway decodes for one message."""


def check_message(data: bytes | bytearray) -> int:
    """Raise Malformed unless `data` is one or more message sections and nothing else, in
    the order AMQP 1.0 §3.2 gives them, each at most once, with a body of one kind: data
    sections, amqp-sequence sections or one amqp-value, and every string valid UTF-8;
    OverLimit past MAX_VALUES values. Returns how many body sections."""
    buf = bytes(data)
    budget = [MAX_VALUES]
    if not buf:
        raise Malformed("empty message")
    pos, last, bodies = 0, -1, 0
    while pos < len(buf):
        if buf[pos] != 0x00:
            raise Malformed(f"byte {pos}: a section must be a described type")
        descriptor, after = _descriptor(buf, pos + 1)
        code = descriptor if descriptor in SECTION_CODES else SECTION_NAMES.get(descriptor)
        if code is None:
            raise Malformed(f"byte {pos}: unknown section descriptor {descriptor!r}")
        if code < last or (code == last and code not in REPEATABLE):
            raise Malformed(f"byte {pos}: section 0x{code:02x} repeated or out of order")
        if code in BODY_CODES:
            if last in BODY_CODES and code != last:
                raise Malformed(f"byte {pos}: a body of more than one kind")
            bodies += 1
        last = code
        pos = _skip(buf, after, 0, budget)
    return bodies


def bare_range(data: bytes) -> tuple[int, int]:
    """Where the bare message (properties, application-properties and the body: what AMQP
    1.0 §3.2 makes immutable in transit) starts and ends in a message check_message passed;
    (n, n) when it has none."""
    start = end = len(data)
    pos = 0
    while pos < len(data):
        code, after = section_at(data, pos)
        if code == FOOTER:
            end = pos
            break
        if code is not None and code >= PROPERTIES and start > pos:
            start = pos
        pos = _skip(data, after, 0)
    return min(start, end), end


def section_span(data: bytes, wanted: int) -> tuple[int, int]:
    """Where the section `wanted` starts and ends in a message check_message passed; (0, 0)
    when it has none."""
    pos = 0
    while pos < len(data):
        code, after = section_at(data, pos)
        end = _skip(data, after, 0)
        if code == wanted:
            return pos, end
        pos = end
    return 0, 0


def section_at(data: bytes, pos: int) -> tuple[int | None, int]:
    """The code of the section starting at pos (a numeric or symbolic descriptor; None
    for one that names no section) and the offset of its value."""
    descriptor, after = _descriptor(data, pos + 1)
    code = descriptor if descriptor in SECTION_CODES else SECTION_NAMES.get(descriptor)
    return code, after


def compound_items(buf: bytes, pos: int) -> tuple[list[bytes], int]:
    """The encoded items of the list or map at pos (each as its own bytes; a map's keys and
    values in turn), and the offset after it; raises Malformed for anything else."""
    code = buf[pos]
    if code == 0x45 or code == 0x40:  # list0, or null for none
        return [], pos + 1
    if code not in (0xC0, 0xD0, 0xC1, 0xD1):
        raise Malformed(f"0x{code:02x} is not a list or map")
    end = _skip(buf, pos, 0)
    at = pos + (3 if code < 0xD0 else 9)
    items = []
    while at < end:
        after = _skip(buf, at, 1)
        items.append(buf[at:after])
        at = after
    return items, end


def _descriptor(buf: bytes, pos: int) -> tuple[int | str | None, int]:
    """The descriptor at pos (a section code or symbol) and the offset after it."""
    _need(buf, pos, 1)
    code = buf[pos]
    if code == 0x53:
        _need(buf, pos + 1, 1)
        return buf[pos + 1], pos + 2
    if code == 0x80:
        _need(buf, pos + 1, 8)
        return int.from_bytes(buf[pos + 1 : pos + 9], "big"), pos + 9
    if code in (0xA3, 0xB3):
        end = _skip(buf, pos, 0)
        start = pos + (2 if code == 0xA3 else 5)
        return buf[start:end].decode("ascii", "replace"), end
    return None, _skip(buf, pos, 0)


def _skip(buf: bytes, pos: int, depth: int, budget: list[int] | None = None) -> int:
    """The offset after the encoded value at pos; raises Malformed if it runs past the end,
    and OverLimit once it has met more values than `budget` holds (it counts them down)."""
    if depth > MAX_DEPTH:
        raise Malformed("values nested too deeply")
    if budget is not None:
        _spend(budget, 1)
    _need(buf, pos, 1)
    code = buf[pos]
    pos += 1
    if code == 0x00:  # described: descriptor, then the value
        return _skip(buf, _skip(buf, pos, depth + 1, budget), depth + 1, budget)
    category = code >> 4
    if category in _FIXED_WIDTH:
        width = _FIXED_WIDTH[category]
        _need(buf, pos, width)
        return pos + width
    if category in (0xA, 0xC, 0xE):  # variable / compound / array, one-byte size
        _need(buf, pos, 1)
        return _end(buf, pos + 1, buf[pos], code, category == 0xC, depth, budget)
    if category in (0xB, 0xD, 0xF):  # the same with a four-byte size
        _need(buf, pos, 4)
        return _end(buf, pos + 4, _U32(buf, pos)[0], code, category == 0xD, depth, budget)
    raise Malformed(f"unknown constructor 0x{code:02x}")


def _end(
    buf: bytes,
    start: int,
    size: int,
    code: int,
    compound: bool,
    depth: int,
    budget: list[int] | None,
) -> int:
    """Check a sized value's extent (and a list's or map's elements) and return its end."""
    end = start + size
    _need(buf, start, size)
    if budget is not None and code in (0xE0, 0xF0) and size:  # an array: its count first
        _spend(budget, buf[start] if code == 0xE0 else _U32(buf, start)[0])
    if code in _TEXT_CODES:
        try:
            buf[start:end].decode()
        except UnicodeDecodeError:
            raise Malformed("a string or symbol is not valid UTF-8") from None
    elif compound:
        wide = code >= 0xD0
        width = 4 if wide else 1
        if size < width:
            raise Malformed("compound value shorter than its count")
        count = _U32(buf, start)[0] if wide else buf[start]
        if code & 1 and count % 2:  # map8 / map32: keys and values in pairs
            raise Malformed("map with an odd number of items")
        pos = start + width
        if budget is not None and count > budget[0]:  # before walking them
            _spend(budget, count)
        for _ in range(count):
            pos = _skip(buf, pos, depth + 1, budget)
            if pos > end:
                raise Malformed("compound value overruns its size")
        if pos != end:
            raise Malformed("compound value size does not match its elements")
    return end


def _spend(budget: list[int], values: int) -> None:
    """Count `values` off a message's budget; OverLimit once it is spent."""
    budget[0] -= values
    if budget[0] < 0:
        raise OverLimit(f"more than {MAX_VALUES} values")


def _need(buf: bytes, pos: int, n: int) -> None:
    if pos + n > len(buf):
        raise Malformed("truncated message")
