"""Listening sockets for the router's server, shared by several processes with
``SO_REUSEPORT`` (``serve --workers N``)."""

from __future__ import annotations

import errno
import sys

import trio

#: Whether this platform can share one port among processes (Linux, the BSDs, macOS; not
#: Windows). Only Linux spreads the connections over the processes evenly.
REUSE_PORT_SUPPORTED = hasattr(trio.socket, "SO_REUSEPORT")


async def open_listeners(
    host: str, port: int, *, reuse_port: bool = False
) -> list[trio.SocketListener]:
    """Listening TCP sockets on ``host``:``port``, one per address ``host`` resolves to.

    Without ``reuse_port`` this is :func:`trio.open_tcp_listeners`. With it, each socket
    is opened here with ``SO_REUSEPORT`` set before it is bound, so that every process of
    ``serve --workers N`` listens on the same port and the kernel spreads new connections
    over them (by a hash of the connection's addresses, on Linux).

    Args:
        host: the address (or name) to listen on.
        port: the TCP port; 0 picks a free one.
        reuse_port: set ``SO_REUSEPORT`` on each socket.

    Returns:
        The listeners, already listening.

    Raises:
        OSError: an address could not be bound, or ``reuse_port`` on a platform
            without ``SO_REUSEPORT``.
    """
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host)
    if not REUSE_PORT_SUPPORTED:
        raise OSError(errno.ENOPROTOOPT, "SO_REUSEPORT is not supported on this platform")
    addresses = await trio.socket.getaddrinfo(
        host, port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    try:
        for family, kind, proto, _, address in addresses:
            sock = trio.socket.socket(family, kind, proto)
            try:
                if sys.platform != "win32":  # as trio.open_tcp_listeners does
                    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
                sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
                if family == trio.socket.AF_INET6:
                    sock.setsockopt(trio.socket.IPPROTO_IPV6, trio.socket.IPV6_V6ONLY, 1)
                await sock.bind(address)
                sock.listen(trio.socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    return listeners
