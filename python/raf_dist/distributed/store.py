"""A TCP key-value store for rendezvous: the launchers of a job and their workers meet here.

The server runs in node 0's launcher (``raf_dist.run``), bound to the address it is given
(``127.0.0.1`` for a one-node job, so nothing off the host can reach it); launchers and
workers are clients. Operations, as torch's ``TCPStore`` offers them: ``set``, ``get`` (waits
until the key exists, up to a timeout), ``add`` (an integer counter), ``compare_set``,
``delete`` and ``check`` (does each key exist, without waiting).

Joining needs the job's token: the server opens every connection with a random challenge and
the client answers with HMAC-SHA256(token, challenge), so a stray connection (another job on
the same port, a port scanner) can neither read nor write the rendezvous, and the token never
crosses the wire. Values are not encrypted: they are port names and small records.

What was evaluated before writing this (about 200 lines on the standard library):
- torch's ``TCPStore`` (C++, libuv): the model for the operations; torch is only the test
  oracle here, not a dependency of raf_dist, and it has no authentication.
- ``multiprocessing.managers`` / ``multiprocessing.connection``: have an HMAC ``authkey``
  handshake but exchange pickles, and a blocking "get with timeout" on a shared dict needs a
  proxy per waiter; unpickling what a network peer sends is what this store must never do.
- MPI's own name service (``MPI_Publish_name`` / ``Lookup_name``): needs ``hydra_nameserver``
  started beside the job, has no timeouts and no counters, and does not exist before MPI does.
- etcd / Redis: an external service to install and run on every cluster; torchrun's etcd
  backend is deprecated in favour of the c10d (TCPStore) one for the same reason.

Wire format: every message is a 4-byte big-endian length followed by that many bytes, which
hold a list of byte strings (a 4-byte count, then each one as length + bytes). A request is
``[command, *arguments]``; a reply is ``[b"ok", *values]``, ``[b"timeout"]`` or
``[b"error", message]``. Lengths are checked before anything is allocated.
"""
import hashlib
import hmac
import logging
import os
import socket
import socketserver
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger("raf_dist")

_MAGIC = b"raf_dist-store-1"
#: no rendezvous value comes anywhere near this; a larger length is a peer speaking another
#: protocol (or an attacker), and must not make the server allocate it
_MAX_MESSAGE_BYTES = 1 << 20
#: an unauthenticated connection gets this long to answer the challenge
_HANDSHAKE_SECONDS = 10.0
#: a reply may arrive this long after a server-side wait ended (a loaded machine or network)
_REPLY_MARGIN_SECONDS = 30.0


class StoreError(RuntimeError):
    """The store refused a request, or could not be reached."""


def _pack(parts: Sequence[bytes]) -> bytes:
    body = struct.pack(">I", len(parts)) + b"".join(
        struct.pack(">I", len(p)) + bytes(p) for p in parts)
    return struct.pack(">I", len(body)) + body


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    chunks, remaining = [], count
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 16))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket) -> List[bytes]:
    (length,) = struct.unpack(">I", _recv_exactly(sock, 4))
    if length > _MAX_MESSAGE_BYTES or length < 4:
        raise ConnectionError(f"a message of {length} bytes is not a raf_dist store message")
    body = _recv_exactly(sock, length)
    (count,) = struct.unpack_from(">I", body, 0)
    parts, offset = [], 4
    for _ in range(count):
        if offset + 4 > length:
            raise ConnectionError("truncated store message")
        (size,) = struct.unpack_from(">I", body, offset)
        offset += 4
        if offset + size > length:
            raise ConnectionError("truncated store message")
        parts.append(body[offset:offset + size])
        offset += size
    if offset != length:
        raise ConnectionError("trailing bytes in a store message")
    return parts


def _proof(token: str, challenge: bytes) -> bytes:
    return hmac.new(token.encode(), challenge, hashlib.sha256).digest()


class _Table:
    """The key-value data, shared by the connection threads."""

    def __init__(self) -> None:
        self.data: Dict[bytes, bytes] = {}
        self.changed = threading.Condition()
        self.closing = False

    def handle(self, request: List[bytes]) -> List[bytes]:
        command, args = request[0], request[1:]
        with self.changed:
            if command == b"set" and len(args) == 2:
                self.data[args[0]] = args[1]
                self.changed.notify_all()
                return [b"ok"]
            if command == b"get" and len(args) == 2:
                key, timeout = args[0], int(args[1]) / 1000.0
                found = self.changed.wait_for(lambda: key in self.data or self.closing, timeout)
                if self.closing:
                    return [b"error", b"the store is shutting down"]
                return [b"ok", self.data[key]] if found else [b"timeout"]
            if command == b"add" and len(args) == 2:
                value = int(self.data.get(args[0], b"0")) + int(args[1])
                self.data[args[0]] = str(value).encode()
                self.changed.notify_all()
                return [b"ok", self.data[args[0]]]
            if command == b"compare_set" and len(args) == 3:
                key, expected, desired = args
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self.data[key] = desired
                    self.changed.notify_all()
                    return [b"ok", desired]
                return [b"ok", b"" if current is None else current]
            if command == b"delete" and len(args) == 1:
                return [b"ok", b"1" if self.data.pop(args[0], None) is not None else b"0"]
            if command == b"check":
                return [b"ok", *(b"1" if key in self.data else b"0" for key in args)]
        return [b"error", b"unknown request " + command[:40]]

    def close(self) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify_all()


class _Connection(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock, table, token = self.request, self.server.table, self.server.token
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.lock:
            self.server.connections.add(sock)
        try:
            challenge = os.urandom(32)
            sock.settimeout(_HANDSHAKE_SECONDS)
            sock.sendall(_pack([_MAGIC, challenge]))
            answer = _receive(sock)
            if len(answer) != 1 or not hmac.compare_digest(answer[0], _proof(token, challenge)):
                logger.warning("rendezvous store: refused a connection from %s:%d with a wrong "
                               "job token", *self.client_address[:2])
                sock.sendall(_pack([b"error", b"wrong job token"]))
                return
            sock.sendall(_pack([b"ok"]))
            sock.settimeout(None)
            while True:
                request = _receive(sock)
                try:
                    reply = table.handle(request) if request else [b"error", b"empty request"]
                except ValueError as err:  # a number that does not parse
                    reply = [b"error", str(err).encode()[:200]]
                sock.sendall(_pack(reply))
        except (ConnectionError, OSError, struct.error):
            pass  # the peer left or spoke garbage: its connection ends, the data is untouched
        finally:
            with self.server.lock:
                self.server.connections.discard(sock)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    # a restarted job may reuse the port while the last one's connections sit in TIME_WAIT;
    # Linux still refuses the bind while another socket listens on it
    allow_reuse_address = True


class StoreServer:
    """Serves a store on ``(host, port)`` from background threads; port 0 picks a free one.

    Raises ``OSError`` with the address and the fix when the port cannot be bound."""

    def __init__(self, host: str, port: int, token: str) -> None:
        try:
            self._server = _Server((host, port), _Connection)
        except OSError as err:
            raise OSError(err.errno, f"cannot listen on {host}:{port} for the rendezvous store "
                          f"({err.strerror}): pick another --master-port, or end the job that "
                          f"uses it") from None
        self._server.table = _Table()
        self._server.token = token
        self._server.lock = threading.Lock()
        self._server.connections = set()
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="raf_dist-store", daemon=True)
        self._thread.start()

    @property
    def address(self) -> Tuple[str, int]:
        return self._server.server_address[:2]

    def close(self) -> None:
        self._server.table.close()
        self._server.shutdown()
        self._server.server_close()
        with self._server.lock:  # clients learn at once that the store is gone
            for sock in list(self._server.connections):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its peer


class StoreClient:
    """A connection to the store; thread-safe (one request at a time).

    ``connect_timeout``: how long to keep trying to reach the server (node 0's launcher may
    start after the others). ``timeout``: the default wait of ``get``."""

    def __init__(self, host: str, port: int, token: str, connect_timeout: float = 60.0,
                 timeout: float = 300.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._lock = threading.Lock()
        self._sock = self._connect(token, connect_timeout)

    def _where(self) -> str:
        return f"the rendezvous store at {self.host}:{self.port}"

    def _connect(self, token: str, connect_timeout: float) -> socket.socket:
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=10.0)
                break
            except OSError as err:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"could not reach {self._where()} within {connect_timeout:.0f} s "
                        f"({err}): is node 0's launcher running, and are --master-addr and "
                        f"--master-port the same on every node?") from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = _receive(sock)
            if len(hello) != 2 or hello[0] != _MAGIC:
                raise ConnectionError("not a raf_dist store")
            sock.sendall(_pack([_proof(token, hello[1])]))
            verdict = _receive(sock)
        except (ConnectionError, OSError, struct.error) as err:
            sock.close()
            raise StoreError(f"{self.host}:{self.port} does not answer as a raf_dist rendezvous "
                             f"store ({err}): another program uses that port; pick another "
                             f"--master-port") from None
        if verdict != [b"ok"]:
            sock.close()
            raise StoreError(f"{self._where()} refused this job's token: every node of a job "
                             f"must be given the same --rdzv-token (another job may be using "
                             f"this port)")
        sock.settimeout(None)
        return sock

    def _request(self, parts: Sequence[bytes], wait: float = 0.0) -> List[bytes]:
        with self._lock:
            try:
                self._sock.settimeout(wait + _REPLY_MARGIN_SECONDS)
                self._sock.sendall(_pack(parts))
                reply = _receive(self._sock)
            except (ConnectionError, OSError, struct.error) as err:
                raise StoreError(f"lost the connection to {self._where()} ({err}): node 0's "
                                 f"launcher has ended") from None
        if reply[:1] == [b"error"]:
            raise StoreError(f"{self._where()}: {b''.join(reply[1:]).decode(errors='replace')}")
        return reply

    def set(self, key: str, value: bytes) -> None:
        self._request([b"set", key.encode(), value])

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """The value of ``key``, waiting until some client sets it; ``TimeoutError`` after
        ``timeout`` seconds (default: the client's)."""
        wait = self.timeout if timeout is None else timeout
        reply = self._request([b"get", key.encode(), str(int(wait * 1000)).encode()], wait)
        if reply == [b"timeout"]:
            raise TimeoutError(f"{key!r} was not set in {self._where()} within {wait:.0f} s")
        return reply[1]

    def add(self, key: str, delta: int) -> int:
        """Adds ``delta`` to the counter ``key`` (0 when absent) and returns the new value."""
        return int(self._request([b"add", key.encode(), str(delta).encode()])[1])

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (``b""``: if it is absent);
        returns the value it holds afterwards, so the caller knows whether it won."""
        return self._request([b"compare_set", key.encode(), expected, desired])[1]

    def delete(self, key: str) -> bool:
        return self._request([b"delete", key.encode()])[1] == b"1"

    def check(self, keys: Sequence[str]) -> List[bool]:
        """Whether each key exists, without waiting."""
        return [v == b"1" for v in self._request([b"check", *(k.encode() for k in keys)])[1:]]

    @property
    def local_address(self) -> str:
        """The address this client reaches the store from: this host's address on the route
        to node 0, which the other nodes can use too."""
        return self._sock.getsockname()[0]

    def close(self) -> None:
        with self._lock:
            self._sock.close()
