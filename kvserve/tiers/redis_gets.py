"""RawGets: Redis GETs whose replies are read straight from the socket into an `entry_buffer`
(RedisTier.get). redis-py's reader copies a large reply through growing buffers: 16 GETs of 2.9 MB
took 58-87 ms that way, 13-25 ms this way. Each thread has a connection of its own, made by the
client's pool with its options (address, TLS, AUTH, db, timeouts) and used for nothing else."""

from __future__ import annotations

import socket
import threading

import redis

from kvserve.tiers.entry import entry_buffer


class RawGets:
    def __init__(self, client: redis.Redis):
        self._client = client
        self._local = threading.local()  # each thread's connection and the generation it was made in
        self._generation = 0  # connections made before the last outage are dead

    def renew(self) -> None:
        """Redis came back after an outage: every thread's connection is replaced on its next GET."""
        self._generation += 1

    def get(self, name: bytes) -> memoryview | None:
        """GET `name` on this thread's connection (no reader of redis-py's holds bytes of its replies).
        A RESP error reply raises redis.ResponseError; a broken or timed-out socket raises OSError (or
        redis's ConnectionError when connecting)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "generation", -1) != self._generation:
            self.drop()  # made before an outage: its socket is dead
            conn = None
        if conn is None:
            conn = self._client.connection_pool.make_connection()
            conn.connect()
            self._local.conn, self._local.generation = conn, self._generation
        conn.send_command("GET", name)
        sock: socket.socket | None = getattr(conn, "_sock", None)  # redis-py's Connection socket
        if sock is None:
            raise ConnectionResetError("redis connection has no socket")
        line = read_line(sock)
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            raise redis.ResponseError(rest.decode("utf-8", "replace"))
        if kind == b"_" or (kind == b"$" and rest == b"-1"):  # nil (RESP3 or RESP2)
            return None
        if kind != b"$":
            self.drop()
            raise redis.RedisError(f"unexpected reply to GET: {line[:40]!r}")
        size = int(rest)
        buf = entry_buffer(size + 2)  # the value and its CRLF
        recv_exactly(sock, buf)
        return buf[:size]

    def drop(self) -> None:
        """Disconnect this thread's connection (the next GET makes a new one)."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.disconnect()


def read_line(sock: socket.socket) -> bytes:
    """One RESP line without its CRLF (short: a type byte and a length or a message)."""
    line = bytearray()
    while not line.endswith(b"\r\n"):
        byte = sock.recv(1)
        if not byte:
            raise ConnectionResetError("redis closed the connection")
        line += byte
        if len(line) > 65536:
            raise redis.RedisError("a RESP line over 64 KiB")
    return bytes(line[:-2])


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError("redis closed the connection mid-reply")
        got += n
