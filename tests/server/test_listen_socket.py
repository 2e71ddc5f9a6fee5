"""The socket ``rnnserve serve`` listens on: connections it accepts send small writes at once."""

from __future__ import annotations

import asyncio
import socket

from rnnserve.server.http_server import listen_socket


def test_accepted_connections_disable_nagle() -> None:
    """asyncio turns on TCP_NODELAY only for sockets whose protocol says TCP; a socket made with protocol 0
    would leave every streamed chunk and response body to Nagle's algorithm."""

    async def nodelay_of_accepted_connection() -> int:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[int] = loop.create_future()

        class Accept(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        sock = listen_socket("127.0.0.1", 0)
        server = await loop.create_server(Accept, sock=sock)
        try:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            result = await asyncio.wait_for(accepted, 10)
            writer.close()
            return result
        finally:
            server.close()

    assert asyncio.run(nodelay_of_accepted_connection()) == 1
