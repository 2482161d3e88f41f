"""A raw AMQP 1.0 peer for hostile-input tests: frames built with proton's Data codec and
sent over a plain asyncio stream, so a test can send what no client library would."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass

from proton import Data, Described, symbol, ubyte, uint, ulong

AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"
OPEN, BEGIN, ATTACH, FLOW, TRANSFER, DISPOSITION, DETACH, END, CLOSE = range(0x10, 0x19)
SASL_MECHANISMS, SASL_INIT, SASL_OUTCOME = 0x40, 0x41, 0x44
SOURCE, TARGET, ACCEPTED, REJECTED = 0x28, 0x29, 0x24, 0x25
SENDER, RECEIVER = False, True
TIMEOUT = 5.0


def encode(value: object) -> bytes:
    data = Data()
    data.put_object(value)
    return bytes(data.encode())


def performative(code: int, *fields: object) -> bytes:
    return encode(Described(ulong(code), list(fields)))


def frame(body: bytes = b"", channel: int = 0, kind: int = 0, doff: int = 2) -> bytes:
    """One frame: `body` (a performative and payload) after a header of `doff` words."""
    pad = b"\x00" * (doff * 4 - 8)
    return struct.pack(">IBBH", 8 + len(pad) + len(body), doff, kind, channel) + pad + body


@dataclass
class Frame:
    channel: int
    code: int | None  # the performative's descriptor; None for an empty frame
    fields: list
    payload: bytes

    def error(self) -> str | None:
        """The condition name of a close, end or detach (or None)."""
        index = {CLOSE: 0, END: 0, DETACH: 2}.get(self.code or 0)
        if index is None or len(self.fields) <= index:
            return None
        error = self.fields[index]
        return str(error.value[0]) if isinstance(error, Described) else None

    def deliveries(self) -> range:
        """The delivery ids a disposition covers."""
        first, last = self.fields[1], self.fields[2]
        return range(first, (first if last is None else last) + 1)

    def outcome(self) -> tuple[int, str | None]:
        """A disposition's state: (descriptor, condition name of a rejected outcome)."""
        state = self.fields[4]
        error = state.value[0] if state.value else None
        return int(state.descriptor), str(error.value[0]) if isinstance(error, Described) else None


def parse(body: bytes, channel: int) -> Frame:
    if not body:
        return Frame(channel, None, [], b"")
    data = Data()
    used = data.decode(body)
    data.rewind()
    data.next()
    value = data.get_object()
    fields = [bytes(v) if isinstance(v, memoryview) else v for v in value.value]
    return Frame(channel, int(value.descriptor), fields, bytes(body[used:]))


class Peer:
    """One raw connection to the gateway."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.header = b""

    @classmethod
    async def connect(cls, port: int) -> Peer:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    @classmethod
    async def opened(cls, port: int, max_frame: int = 65536, window: int = 1000) -> Peer:
        """Connected, AMQP header exchanged, open sent and answered, session 0 begun
        (taking at most `window` transfers at once)."""
        peer = await cls.connect(port)
        peer.send(AMQP_HEADER + frame(performative(OPEN, "raw", None, uint(max_frame))))
        assert await peer.read_header() == AMQP_HEADER
        assert (await peer.expect(OPEN)).code == OPEN
        peer.send(frame(performative(BEGIN, None, uint(0), uint(window), uint(1000))))
        assert (await peer.expect(BEGIN)).code == BEGIN
        return peer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read_header(self) -> bytes:
        self.header = await asyncio.wait_for(self.reader.readexactly(8), TIMEOUT)
        return self.header

    async def read(self) -> Frame | None:
        """The next frame; None at EOF."""
        try:
            head = await asyncio.wait_for(self.reader.readexactly(8), TIMEOUT)
            size, doff, _, channel = struct.unpack(">IBBH", head)
            rest = await asyncio.wait_for(self.reader.readexactly(size - 8), TIMEOUT)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return parse(rest[doff * 4 - 8 :], channel)

    async def expect(self, code: int) -> Frame:
        """The next frame with performative `code` (others skipped); AssertionError at EOF."""
        while (got := await self.read()) is not None:
            if got.code == code:
                return got
        raise AssertionError(f"EOF before performative 0x{code:x}")

    async def closed_with(self) -> str | None:
        """The condition of the close the gateway sends (frames before it skipped), after
        checking the socket then reaches EOF."""
        close = await self.expect(CLOSE)
        assert await self.eof(), "the socket stayed open after close"
        return close.error()

    async def eof(self) -> bool:
        """True once the gateway has closed the socket (data before EOF is discarded); the
        socket is closed on this side then too."""
        try:
            while await asyncio.wait_for(self.reader.read(65536), TIMEOUT):
                pass
        except ConnectionError:
            pass
        except TimeoutError:
            return False
        self.writer.close()
        return True

    def attach(
        self,
        name: str,
        handle: int,
        role: bool,
        address: str | None,
        snd_mode: int = 0,
        rcv_mode: int = 0,
    ) -> None:
        """`snd_mode`: 0 unsettled, 1 settled, 2 mixed; `rcv_mode`: 0 first, 1 second."""
        terminus = Described(ulong(SOURCE if role else TARGET), [address])
        other = Described(ulong(TARGET if role else SOURCE), [None])
        source, target = (terminus, other) if role else (other, terminus)
        modes = ubyte(snd_mode), ubyte(rcv_mode)
        self.send(frame(performative(ATTACH, name, uint(handle), role, *modes, source, target)))

    async def frames_for(self, seconds: float) -> list[Frame]:
        """Every frame that arrives within `seconds`."""
        got = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while (f := await self.read()) is not None:
                    got.append(f)
        return got

    def transfer(
        self,
        handle: int,
        delivery_id: int | None,
        payload: bytes,
        more: bool = False,
        settled: bool = False,
        tag: bytes | None = b"t",
        aborted: bool = False,
    ) -> None:
        fields: list = [uint(handle), None if delivery_id is None else uint(delivery_id), tag]
        fields += [uint(0), settled, more, None, None, None, aborted]
        self.send(frame(performative(TRANSFER, *fields) + payload))

    async def sender(self, handle: int, address: str) -> None:
        """Attach a sending link and wait for its credit."""
        self.attach(f"s{handle}", handle, SENDER, address)
        assert (await self.expect(ATTACH)).fields[6] is not None, "refused"
        await self.expect(FLOW)

    async def send_all(self, handle: int, payloads: list[bytes], first_id: int = 0) -> list:
        """Send `payloads` as unsettled deliveries; their outcomes, as (state descriptor,
        condition name), in order."""
        for i, payload in enumerate(payloads):
            self.transfer(handle, first_id + i, payload, tag=b"%d" % i)
        outcomes: dict[int, tuple[int, str | None]] = {}
        while len(outcomes) < len(payloads):
            got = await self.expect(DISPOSITION)
            for delivery in got.deliveries():
                outcomes[delivery - first_id] = got.outcome()
        return [outcomes[i] for i in range(len(payloads))]

    async def receive(self, handle: int, address: str, count: int) -> list[bytes]:
        """Attach a receiving link, take `count` single-frame deliveries and accept them."""
        self.attach(f"r{handle}", handle, RECEIVER, address)
        await self.expect(ATTACH)
        self.send(flow(handle, count))
        got = []
        while len(got) < count:
            transfer = await self.expect(TRANSFER)
            got.append(transfer.payload)
            accepted = Described(ulong(ACCEPTED), [])
            delivery = transfer.fields[1]
            self.send(frame(performative(DISPOSITION, RECEIVER, delivery, None, True, accepted)))
        return got

    def close(self) -> None:
        self.writer.close()


def flow(
    handle: int | None,
    credit: int,
    delivery_count: int = 0,
    drain: bool = False,
    window: int = 1000,
) -> bytes:
    """A flow frame; `window`: the session's incoming window."""
    fields: list = [uint(0), uint(window), uint(0), uint(1000)]
    if handle is not None:
        fields += [uint(handle), uint(delivery_count), uint(credit), None, drain]
    return frame(performative(FLOW, *fields))


def sasl_init(mechanism: str, response: bytes | None = None) -> bytes:
    return frame(performative(SASL_INIT, symbol(mechanism), response), kind=1)
