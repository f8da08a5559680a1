"""Redis clients from a URL: one server or a Redis Cluster, chosen by the URL's scheme.

``redis://``, ``rediss://`` and ``unix://`` name one server (redis-py's ``Redis``).
``redis+cluster://host:port/0`` (``rediss+cluster://`` with TLS) names a Redis Cluster by any one
of its nodes: the client (redis-py's ``RedisCluster``) learns the slot map from it and routes every
command by its key's slot, following ``MOVED`` and ``ASK`` (docs/memory-search.md "Shards").

The stores type their client as ``Redis``: they use the command surface both clients share
(single-key commands, pipelines and transactions, Lua over keys of one hash tag, ``FT.*`` whose
index name carries the hash tag of its documents), so the same code runs on both.
"""

from __future__ import annotations

from typing import Any, cast

import redis
import redis.cluster
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster
from redis.cluster import PRIMARY
from redis.crc import key_slot as crc_key_slot

CLUSTER_SCHEME = "redis+cluster"
# What a Redis call may raise: redis-py's cluster client reports an unreachable cluster with an
# exception outside RedisError, so a command line that caught only that printed a traceback.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, redis.exceptions.RedisClusterException)
_CLUSTER_SCHEMES = {f"{CLUSTER_SCHEME}://": "redis://", "rediss+cluster://": "rediss://"}


def is_cluster_url(url: str) -> bool:
    """True when ``url`` names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return any(url.startswith(s) for s in _CLUSTER_SCHEMES)


def node_url(url: str) -> str:
    """The plain ``redis://`` URL of the node a cluster URL names (a plain URL unchanged)."""
    for scheme, plain in _CLUSTER_SCHEMES.items():
        if url.startswith(scheme):
            return plain + url[len(scheme):]
    return url


class _AsyncCluster(RedisCluster):
    """redis-py's asyncio cluster client, also following ``ASK`` to a node its map does not hold:
    a shard added while the client runs (``ibex-context cluster add-shard``) is first met through
    the ``ASK`` of a slot moving to it, and redis-py looks the node up without adding it (every such
    command failed with ``AttributeError`` until the client's next ``MOVED``)."""

    def get_node(self, host: str | None = None, port: int | None = None,
                 node_name: str | None = None) -> AsyncClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None and host and port:
            nodes = self.nodes_manager
            node = AsyncClusterNode(host, port, PRIMARY, **nodes.connection_kwargs)
            nodes.set_nodes(nodes.nodes_cache, {node.name: node})
        return node


class _SyncCluster(redis.cluster.RedisCluster):
    """The blocking client with the same ``ASK`` fix (``_AsyncCluster``)."""

    def get_node(self, host: str | None = None, port: int | None = None,
                 node_name: str | None = None) -> redis.cluster.ClusterNode | None:
        node = super().get_node(host, port, node_name)  # type: ignore[no-untyped-call]
        if node is None and host and port:
            node = redis.cluster.ClusterNode(host, port, PRIMARY)  # type: ignore[no-untyped-call]
            self.nodes_manager.nodes_cache[node.name] = node
        return cast("redis.cluster.ClusterNode | None", node)


def async_client(url: str, **kwargs: Any) -> Redis:
    """An asyncio client for ``url``: ``RedisCluster`` for a cluster URL, else ``Redis``.

    ``kwargs`` go to the connections (timeouts, protocol, retry); options only a single-server
    client takes (``connection_class``) are dropped for a cluster.
    """
    if not is_cluster_url(url):
        return Redis.from_url(url, **kwargs)
    kwargs.pop("connection_class", None)
    return cast(Redis, _AsyncCluster.from_url(node_url(url), **kwargs))


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for ``url`` (the admin tools): ``redis.RedisCluster`` for a cluster URL."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    try:  # the blocking client connects here to learn the slot map
        return cast(redis.Redis, _SyncCluster.from_url(node_url(url), **kwargs))
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: callers catch that one
        raise redis.ConnectionError(str(exc)) from None


def is_cluster(client: object) -> bool:
    """True for a cluster client (sync or asyncio)."""
    return isinstance(client, RedisCluster | redis.cluster.RedisCluster)


def key_slot(key: str) -> int:
    """The cluster slot of ``key`` (CRC16 of its hash tag, or of the whole key)."""
    return int(crc_key_slot(key.encode()))
