"""The rendezvous store (raf_dist/distributed/store.py) in one process: operations, waits and
timeouts, the job token, a port in use, defensive parsing of what a stray peer sends."""
import socket
import struct
import threading
import time

import pytest

from raf_dist.distributed.store import StoreClient, StoreError, StoreServer

TOKEN = "job-token-1"


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", 0, TOKEN)
    yield srv
    srv.close()


def _client(srv, token=TOKEN, **kwargs):
    return StoreClient(*srv.address, token, **kwargs)


def test_set_get_add_compare_set_delete_check(server):
    a, b = _client(server), _client(server)
    a.set("k", b"v1")
    assert b.get("k") == b"v1"
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5 and b.add("n", -5) == 0
    assert a.compare_set("c", b"", b"first") == b"first"  # absent + expected "": set
    assert b.compare_set("c", b"", b"second") == b"first"  # someone won already
    assert b.compare_set("c", b"first", b"third") == b"third"
    assert a.compare_set("c", b"nope", b"x") == b"third"
    assert a.check(["c", "missing", "k"]) == [True, False, True]
    assert a.delete("c") is True and a.delete("c") is False
    assert a.check(["c"]) == [False]
    a.set("bin", bytes(range(256)))
    assert b.get("bin") == bytes(range(256))


def test_get_waits_for_a_later_set(server):
    a, b = _client(server), _client(server)
    threading.Timer(0.3, a.set, ("late", b"here")).start()
    start = time.monotonic()
    assert b.get("late", timeout=10) == b"here"
    assert 0.2 < time.monotonic() - start < 5  # woke on the set, not on the timeout


def test_get_times_out_naming_the_key(server):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="'never' was not set .* within 0 s"):
        _client(server).get("never", timeout=0.3)
    assert time.monotonic() - start < 5


def test_wrong_token_is_refused_and_changes_nothing(server):
    good = _client(server)
    good.set("k", b"v")
    with pytest.raises(StoreError, match="refused this job's token.*same --rdzv-token"):
        _client(server, token="other")
    assert good.get("k") == b"v"


def test_port_in_use_names_the_fix(server):
    host, port = server.address
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}.*another --master-port"):
        StoreServer(host, port, TOKEN)


def test_unreachable_store_times_out_with_a_message():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StoreError, match="could not reach the rendezvous store at 127.0.0.1"):
        StoreClient("127.0.0.1", port, TOKEN, connect_timeout=0.5)
    assert time.monotonic() - start < 5


def test_another_service_on_the_port_is_named():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def speak_http():
        conn, _ = listener.accept()
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    threading.Thread(target=speak_http, daemon=True).start()
    with pytest.raises(StoreError, match="does not answer as a raf_dist rendezvous store"):
        StoreClient(*listener.getsockname(), TOKEN, connect_timeout=2)
    listener.close()


@pytest.mark.parametrize("garbage", [
    struct.pack(">I", 1 << 30),                      # an absurd length: must not be allocated
    struct.pack(">I", 8) + struct.pack(">II", 5, 99),  # a part longer than the message
    b"GET / HTTP/1.1\r\n\r\n",
])
def test_garbage_from_a_stray_peer_is_dropped(server, garbage):
    good = _client(server)
    good.set("k", b"v")
    with socket.create_connection(server.address, timeout=5) as stray:
        stray.recv(1024)  # the challenge
        stray.sendall(garbage)
        stray.settimeout(5)
        try:
            leftover = stray.recv(1024)  # the server hangs up, or refuses
        except ConnectionResetError:
            leftover = b""
        assert b"ok" not in leftover
    assert good.get("k") == b"v" and good.add("n", 1) == 1  # the store still serves


def test_closing_the_server_fails_clients_at_once(server):
    client = _client(server)
    waiting = []

    def wait():
        try:
            client.get("never", timeout=60)
        except StoreError as err:
            waiting.append(str(err))

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    start = time.monotonic()
    server.close()
    thread.join(10)
    assert time.monotonic() - start < 5 and waiting, waiting
    assert "shutting down" in waiting[0] or "lost the connection" in waiting[0]
