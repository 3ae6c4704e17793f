"""The L3 tier: lower-tier objects in a Mooncake store (``MooncakeDistributedStore``), shared by
every instance that talks to the same ``mooncake_master``.

Configured the way SGLang's HiCache configures its Mooncake backend, by SGLang's own loader
(``MooncakeStoreConfig`` in ``sglang/srt/mem_cache/storage/mooncake_store``): the JSON file named
by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``, or the environment variables ``MOONCAKE_MASTER``,
``MOONCAKE_PROTOCOL`` (``tcp`` on a machine without RDMA), ``MOONCAKE_TE_META_DATA_SERVER``,
``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (this instance's contribution to the pool; ``0`` to contribute
none, e.g. with a standalone store client holding the memory), ``MOONCAKE_LOCAL_HOSTNAME`` and
``MOONCAKE_DEVICE``.

What Mooncake guarantees and what it does not, and what this store does about it:

* Objects are immutable and a put on an existing key succeeds without writing: the object
  format is part of every key (:mod:`sglang_k3.tiers.keys`).
* A put fails when no segment has room (``-600``, ``-200``): the tier refuses softly, the boundary
  is not kept there, serving goes on (``tier_l3_put_refused``).
* Objects live in the memory of the client that contributed the segment; a client that dies
  takes its objects with it, and a restarted master starts empty. Lookups then miss; nothing
  raises (``tier_l3_errors`` counts calls that failed, e.g. while the master is down).
* Nothing read is trusted before the tier manager validates it (key digest, layout, checksum).

Torch-free; ``mooncake`` is imported when a store is built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from sglang_k3.tiers.host_store import StoreCounters

logger = logging.getLogger(__name__)

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
NO_SPACE = (-600, -200)  # no segment has room / no handle can be evicted: a full tier, not an error


def load_config():
    """SGLang's Mooncake configuration: the JSON file at ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``
    if set, else the ``MOONCAKE_*`` environment variables. Raises ValueError when neither names a
    master."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStoreConfig

    if os.environ.get(CONFIG_PATH_ENV):
        return MooncakeStoreConfig.from_file()
    return MooncakeStoreConfig.load_from_env()


@dataclass
class MooncakeCounters(StoreCounters):
    errors: int = 0  # calls that failed (master down, RPC error): treated as misses / refusals


class MooncakeStore:
    def __init__(self, config, local_buffer_bytes: int, name: str = "l3") -> None:
        from sglang_k3.tiers.system_deps import store_client_class

        self.name = name
        self.config = config
        self._client = store_client_class("the Mooncake L3 tier")()
        rc = self._client.setup(
            config.local_hostname,
            config.metadata_server,
            int(config.global_segment_size),
            int(local_buffer_bytes),
            config.protocol,
            config.device_name or "",
            config.master_server_address,
        )
        if rc != 0:
            raise RuntimeError(
                f"Mooncake store setup failed ({rc}) against master {config.master_server_address!r}, "
                f"metadata {config.metadata_server!r}, protocol {config.protocol!r}"
            )
        self.counters = MooncakeCounters()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        try:
            res = self._client.batch_is_exist(list(keys))
        except Exception:
            logger.exception("k3 tier %s: batch_is_exist failed", self.name)
            res = None
        if res is None or len(res) != len(keys):
            self.counters.errors += 1
            return [False] * len(keys)
        if any(r < 0 for r in res):
            self.counters.errors += 1
        return [r == 1 for r in res]

    def get(self, key: str) -> Optional[bytes]:
        self.counters.gets += 1
        try:
            blob = self._client.get(key)
        except Exception:
            logger.exception("k3 tier %s: get failed", self.name)
            self.counters.errors += 1
            return None
        if not blob:
            return None
        self.counters.get_hits += 1
        self.counters.get_bytes += len(blob)
        return bytes(blob)

    def put(self, key: str, blob: bytes) -> bool:
        try:
            rc = self._client.put(key, blob)
        except Exception:
            logger.exception("k3 tier %s: put failed", self.name)
            rc = None
        if rc != 0:
            if rc not in NO_SPACE:
                self.counters.errors += 1
            self.counters.put_refused += 1
            return False
        self.counters.puts += 1
        self.counters.put_bytes += len(blob)
        return True

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            logger.exception("k3 tier %s: close failed", self.name)

    def stats(self) -> dict[str, int]:
        d = self.counters.as_dict(f"tier_{self.name}")
        d[f"tier_{self.name}_segment_bytes"] = int(self.config.global_segment_size)
        return d
