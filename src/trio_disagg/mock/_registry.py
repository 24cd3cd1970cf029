"""The registry that links in-process mock engines: decode engines find the prefill
engines' KV pools by name (vLLM's ``remote_engine_id``) or by bootstrap address."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .._protocols import DEFAULT_BOOTSTRAP_PORT
from ._kv import KVBlockPool, KVCounters, KVTransferError


class KVRegistry:
    """Links in-process mock workers: decode engines find the prefill engines' pools.

    A prefill engine registers its :class:`KVBlockPool` under its name (vLLM's
    ``remote_engine_id``) and, for the bootstrap style, its bootstrap address. One
    registry per cluster of engines; nothing global.
    """

    def __init__(self) -> None:
        self._pools: dict[str, KVBlockPool] = {}
        self._by_address: dict[tuple[str, int], KVBlockPool] = {}
        self._next_port = DEFAULT_BOOTSTRAP_PORT

    def __repr__(self) -> str:
        return f"<KVRegistry {sorted(self._pools)}>"

    def add(self, pool: KVBlockPool, *, bootstrap_address: tuple[str, int] | None = None
            ) -> None:
        """Register a prefill worker's pool under ``pool.name``.

        Raises:
            ValueError: the name or the bootstrap address is taken.
        """
        if pool.name in self._pools:
            raise ValueError(f"a prefill engine named {pool.name!r} is already registered")
        if bootstrap_address is not None:
            if bootstrap_address in self._by_address:
                raise ValueError(f"bootstrap address {bootstrap_address} is already taken")
            self._by_address[bootstrap_address] = pool
        self._pools[pool.name] = pool

    def allocate_bootstrap_port(self) -> int:
        """A bootstrap port not yet handed out by this registry (8998, 8999, ...)."""
        taken = {port for _, port in self._by_address}
        while self._next_port in taken:
            self._next_port += 1
        port = self._next_port
        self._next_port += 1
        return port

    @property
    def pools(self) -> Mapping[str, KVBlockPool]:
        """The pools by prefill engine name (read-only)."""
        return MappingProxyType(self._pools)

    def pool(self, name: str) -> KVBlockPool:
        """The pool of the prefill engine ``name``.

        Raises:
            KVTransferError: no such engine.
        """
        try:
            return self._pools[name]
        except KeyError:
            raise KVTransferError(f"no prefill engine named {name!r}") from None

    def pool_at(self, host: str, port: int) -> KVBlockPool:
        """The pool of the prefill engine whose bootstrap address is ``host:port``.

        Raises:
            KVTransferError: no such engine.
        """
        try:
            return self._by_address[(host, port)]
        except KeyError:
            raise KVTransferError(f"no prefill engine bootstraps at {host}:{port}") from None

    def counters(self) -> KVCounters:
        """The sum of every pool's counters (after expiring what is due)."""
        total = KVCounters()
        for pool in self._pools.values():
            total = total + pool.counters()
        return total
