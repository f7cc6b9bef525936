"""A replica's prefix-cache events: the chain hashes its block pool added and evicted.

Run inside the replica's engine thread (``EngineCoreClient.call``): the pool's hash index
(``kv_cache/block_pool.BlockPool.by_hash``) is compared with what the previous report
said, so a report costs one set difference over the cached blocks and the KV manager
needs no hook.
"""

from __future__ import annotations

import weakref

from tokenmill.distributed.routing import BlockEvents
from tokenmill.engine.engine import LLMEngine

_REPORTED: weakref.WeakKeyDictionary[LLMEngine, set[bytes]] = weakref.WeakKeyDictionary()


def block_events(engine: LLMEngine) -> BlockEvents:
    """Hashes committed and evicted since this engine's previous report."""
    kv = engine.kv
    pool = getattr(kv, "pool", None)  # a coordinator (hybrid models) caches no prefix
    now = set(pool.by_hash) if pool is not None else set()
    before = _REPORTED.get(engine, set())
    _REPORTED[engine] = now
    return BlockEvents(tuple(now - before), tuple(before - now))
