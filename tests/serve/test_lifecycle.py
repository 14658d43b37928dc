"""The endpoint's life in this process: it starts on a socket it binds, serves, and stops without
leaving a thread or a listening socket behind; a taken port is a one-line error."""

import socket
import threading
import time

import httpx
import pytest
from flax import nnx

from tpurl.generate import Engine, EngineConfig, Service
from tpurl.models.hf import load_hf_checkpoint
from tpurl.serve.app import Endpoint
from tpurl.serve.server import _Server, bind, make_server, url_of
from tpurl.tokenizer import load_hf_tokenizer

pytestmark = pytest.mark.slow


def _started(random_dir):
    """An endpoint on the checkpoint, served by uvicorn on a thread: (service, server, thread,
    socket, url, address)."""
    model = load_hf_checkpoint(random_dir)
    graphdef, params = nnx.split(model)
    engine = Engine(model.config, EngineConfig(max_slots=4, max_seq_len=64, page_size=8, prefill_buckets=(32, 64)),
                    graphdef=graphdef)
    tokenizer = load_hf_tokenizer(random_dir)
    sock = bind("127.0.0.1", 0)
    service = Service(engine, params, tokenizer=tokenizer)
    server = make_server(Endpoint(service, tokenizer, name="m", context_length=64))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)  # a failed stop: no hang
    thread.start()
    return service, server, thread, sock, url_of(sock), sock.getsockname()[:2]


def test_stop_leaves_no_thread_or_socket(random_dir):
    before = set(threading.enumerate())
    service, server, thread, sock, url, address = _started(random_dir)
    try:
        while not server.started:
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
    finally:
        server.should_exit = True
        thread.join(30)
        service.close()
        sock.close()
    assert not thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5)
    end = time.monotonic() + 5
    while (left := set(threading.enumerate()) - before) and time.monotonic() < end:
        time.sleep(0.05)
    assert not left, left


@pytest.mark.parametrize("keep_open", [False, True])
def test_stop_ends_the_server_with_or_without_open_connections(random_dir, monkeypatch, keep_open):
    """`stop()` (what an agent rollout calls) ends the server and closes its socket: with no
    connection open, without uvicorn's shutdown and its wait for connections; with a client's
    keep-alive connection open, through it, which closes that connection."""
    import uvicorn

    shutdowns = []
    real = uvicorn.Server.shutdown

    async def counted(self, sockets=None):
        shutdowns.append(1)
        return await real(self, sockets)

    monkeypatch.setattr(uvicorn.Server, "shutdown", counted)
    monkeypatch.setattr(_Server, "TICK_S", 600.0)  # the server stops within the test only if stop() wakes it
    service, server, thread, sock, url, address = _started(random_dir)
    client = httpx.Client(timeout=60)
    try:
        while not server.started:
            time.sleep(0.05)
        r = client.post(url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200
        if not keep_open:
            client.close()
            end = time.monotonic() + 5
            while server.server_state.connections and time.monotonic() < end:
                time.sleep(0.01)
        assert bool(server.server_state.connections) is keep_open
    finally:
        server.stop()
        thread.join(30)
        client.close()
        service.close()
        sock.close()
    assert not thread.is_alive() and len(shutdowns) == int(keep_open)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5)


def test_a_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: .*; choose another --port"):
            bind("127.0.0.1", port)
