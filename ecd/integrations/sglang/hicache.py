"""EcdHiCacheStorage: SGLang's HiCache L3 storage on the node's ecd daemon.

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "ecd", "module_path": "ecd.integrations.sglang",
        "class_name": "EcdHiCacheStorage", "interface_v1": 1}'

Every SGLang server on the node that runs the same model with the same shard and page geometry
derives the same namespace (settings.derive_namespace), so a page one server stored is a hit for
the others. The zero-copy page path (`interface_v1`: batch_set_v1 / batch_get_v1) copies a page
once each way between SGLang's host pool and the daemon's shared memory; the generic tensor path
(get/set/batch_*), the pool-transfer path (*_v2, KV plus sidecar pools such as mamba, with the hit
policies of SGLang's own HiCacheFile) and batch_exists share the same entries.

Nothing here raises into SGLang's threads: a daemon that is down or restarted, an entry evicted or
deleted between batch_exists and the load, a checksum mismatch (verify) or an entry of the wrong
size is a miss (False / None) for that page, logged rate-limited, and the host page is left as it
was. The client reconnects by itself (ecd.integrations.vllm.lazy_client).

A store copies its pages into the daemon's pool before it returns (SGLang may reuse its host
pages at once) but does not wait for the daemon to commit them (`put_many(wait=False)`): they
are visible to this server at once and to others within a millisecond or so. The next store
settles the ones before it (`flush`): pages the daemon refused (a quota, a limit) are logged then
(`failed_pages` counts one for each store that finds any); SGLang meets them as any page the
cache no longer holds: a miss.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolHitPolicy, PoolName, PoolTransferResult

from ...errors import EcdError
from ..vllm.lazy_client import LOG_INTERVAL_S, LazyClient, batches, skipping_corrupt
from ..vllm.ratelimit import RateLimitedLog
from .pages import PoolPages, load_into
from .settings import HiCacheSettings, derive_namespace, parse_settings, sidecar_tag

log = logging.getLogger("sglang.ecd.hicache")
T = TypeVar("T")
KV_NAMES = ("kv", "__default__")


class EcdHiCacheStorage(HiCacheStorage):
    """SGLang's HiCacheStorage on ecd (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        """SGLang's dynamic backend calls backend_class(storage_config, kwargs)."""
        self.storage_config = storage_config
        self.settings: HiCacheSettings = parse_settings(getattr(storage_config, "extra_config", None))
        self.is_writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.enable_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._log = RateLimitedLog(log, LOG_INTERVAL_S, "ecd hicache: ")
        self._lock = threading.Lock()
        self._client: LazyClient | None = None
        self._kv: PoolPages | None = None
        self._sidecars: dict[str, tuple[PoolPages, str]] = {}  # pool name -> its pages and key suffix
        self._stats_lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}
        self.counters = {"stored_pages": 0, "skipped_pages": 0, "loaded_pages": 0, "missed_pages": 0,
                         "failed_pages": 0, "integrity_failures": 0, "stored_bytes": 0, "loaded_bytes": 0}

    # ---- namespace, client, pools -----------------------------------------------------------

    @property
    def namespace(self) -> str:
        """The configured namespace, or the one derived from the KV host pool (when registered)."""
        if self.settings.namespace:
            return self.settings.namespace
        return derive_namespace(self.storage_config, self._kv.facts() if self._kv is not None else None)

    def client(self) -> LazyClient:
        """The daemon client of this backend's namespace (made on first use, not connected yet)."""
        with self._lock:
            if self._client is None:
                ns = self.namespace
                self._client = LazyClient(self.settings.connector_settings(), ns, f"sglang-hicache:{ns}", self._log)
            return self._client

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = PoolPages(mem_pool_host)
        with self._lock:
            self._kv = pages
            old, self._client = self._client, None  # the namespace hashes this pool's facts
        if old is not None:
            old.close()

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name in KV_NAMES:
            return
        pages = PoolPages(host_pool)
        self._sidecars[name] = (pages, sidecar_tag(self.storage_config, name, pages.facts()))

    def _pool(self, name: Any) -> tuple[PoolPages, str] | None:
        """(pages, key suffix) of a registered pool: the KV pool's keys are SGLang's page hashes."""
        name = str(name)
        if name in KV_NAMES:
            return (self._kv, "") if self._kv is not None else None
        return self._sidecars.get(name)

    def _call(self, op: str, fn: Callable[[Any], T]) -> T | None:
        return self.client().call(op, fn)

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def _metric(self, which: str, pages: int, nbytes: int, seconds: float) -> None:
        if self.enable_metrics and pages:
            with self._stats_lock:
                self._metrics[f"{which}_pgs"].append(pages)
                self._metrics[f"{which}_bandwidth"].append(nbytes / max(seconds, 1e-9) / (1 << 30))

    # ---- the page transfers (v1, v2) ---------------------------------------------------------

    def _page_indices(self, op: str, pages: PoolPages, keys: List[str], host_indices: Any, verb: str):
        """Each key's first host index, or None (logged) when the host indices do not cover the keys."""
        indices = pages.indices(host_indices, len(keys))
        if indices is None:
            self._log.warning(f"{op}:indices", "%s: %d keys but %s host indices (page size %d): nothing %s", op,
                              len(keys), None if host_indices is None else host_indices.numel(), pages.page_size,
                              verb)
        return indices

    def _store_pages(self, op: str, pages: PoolPages | None, suffix: str, keys: List[str],
                     host_indices: Any) -> List[bool]:
        if pages is None:
            self._log.warning(f"{op}:nopool", "%s before a host pool was registered: nothing stored", op)
            return [False] * len(keys)
        indices = self._page_indices(op, pages, keys, host_indices, "stored")
        if indices is None:
            return [False] * len(keys)
        if not self.is_writer:  # MLA: one rank writes the bytes every rank holds
            return [True] * len(keys)
        names = [k + suffix for k in keys]
        start = time.perf_counter()

        if self._call(op, lambda c: self._put_absent(c, names, lambda i: pages.source(indices[i]), start)) is None:
            self._count(failed_pages=len(keys))
            return [False] * len(keys)
        return [True] * len(keys)  # every page is stored now, by this call or an earlier one

    def _put_absent(self, c: Any, names: List[str], value: Callable[[int], torch.Tensor], start: float) -> bool:
        """Store the entries of `names` the daemon does not hold yet (value(i): names[i]'s tensor),
        one exists and one put_many per batch, and count them (pages already there are skipped)."""
        stored = nbytes = 0
        try:
            c.flush()  # the stores before this one, not waited for: what the daemon refused of them
        except EcdError as exc:
            self._count(failed_pages=1)
            self._log.warning("store:refused", "an earlier store was refused by the daemon: %s", exc)
        for chunk in batches(list(range(len(names))), c.limits.max_batch):
            present = c.exists([names[i] for i in chunk])
            items = {names[i]: value(i) for i, here in zip(chunk, present) if not here}
            if items:
                c.put_many(items, checksum=self.settings.verify, wait=False)
                stored += len(items)
                nbytes += sum(v.numel() * v.element_size() for v in items.values())
        self._count(stored_pages=stored, skipped_pages=len(names) - stored, stored_bytes=nbytes)
        self._metric("backup", stored, nbytes, time.perf_counter() - start)
        return True

    def _load_pages(self, op: str, pages: PoolPages | None, suffix: str, keys: List[str],
                    host_indices: Any) -> List[bool]:
        if pages is None:
            return [False] * len(keys)
        indices = self._page_indices(op, pages, keys, host_indices, "loaded")
        if indices is None:
            return [False] * len(keys)
        names = [k + suffix for k in keys]
        start = time.perf_counter()
        result = self._call(op, lambda c: self._load(c, op, names, lambda i, t: pages.load(indices[i], t)))
        if result is None:
            self._count(failed_pages=len(keys))
            return [False] * len(keys)
        self._metric("prefetch", sum(result), sum(result) * pages.page_bytes, time.perf_counter() - start)
        self._count(loaded_bytes=sum(result) * pages.page_bytes)
        return result

    def _load(self, c: Any, op: str, names: List[str], copy: Callable[[int, torch.Tensor], bool]) -> List[bool]:
        """View the entries (Client.read_many: under read leases, or checked against the ring after
        the copies) and copy each found one with copy(i, view). A key failing verification is a miss; the others are viewed again without it (the check runs
        before any copy of its batch is made)."""
        ok = [False] * len(names)
        missed = 0

        def read(chunk: List[int]) -> None:
            nonlocal missed

            def copy_all(views: list) -> list[tuple[bool, int] | None]:  # may run twice (read_many)
                return [None if view is None else (copy(i, view), view.numel() * view.element_size())
                        for i, view in zip(chunk, views)]

            # without a round trip where the pages' locations are known (Client.read_many)
            copied = c.read_many([names[i] for i in chunk], copy_all, missing_ok=True, verify=self.settings.verify)
            for i, outcome in zip(chunk, copied):
                if outcome is None:
                    missed += 1
                elif not outcome[0]:
                    self._log.warning(f"{op}:size", "%s: entry %r has %d bytes, not a page of this pool: "
                                      "treated as a miss", op, names[i], outcome[1])
                else:
                    ok[i] = True

        for chunk in batches(list(range(len(names))), c.limits.max_batch):
            # a verify failure raises before any copy of the batch: the rest is viewed again without it
            _, corrupt = skipping_corrupt([names[i] for i in chunk], lambda picked: read([chunk[p] for p in picked]))
            for p in corrupt:
                self._count(integrity_failures=1)
                self._log.warning(f"{op}:integrity", "%s: entry %r failed verification: treated as a miss", op,
                                  names[chunk[p]])
        self._count(loaded_pages=sum(ok), missed_pages=missed)
        if self.settings.pin_seconds > 0:  # the pins batch_exists took for this load
            c.send_unpin([n for n, done in zip(names, ok) if done])
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        return self._store_pages("batch_set_v1", self._kv, "", list(keys), host_indices)

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        return self._load_pages("batch_get_v1", self._kv, "", list(keys), host_indices)

    def batch_set_v2(self, transfers: List[Any], extra_info: Any = None) -> dict[str, List[bool]]:
        return {t.name: self._store_pages("batch_set_v2", *self._transfer(t), list(t.keys or []), t.host_indices)
                for t in transfers}

    def batch_get_v2(self, transfers: List[Any], extra_info: Any = None) -> dict[str, List[bool]]:
        return {t.name: self._load_pages("batch_get_v2", *self._transfer(t), list(t.keys or []), t.host_indices)
                for t in transfers}

    def _transfer(self, transfer: Any) -> tuple[PoolPages | None, str]:
        found = self._pool(transfer.name)
        if found is None:
            self._log.warning(f"v2:{transfer.name}", "pool %s is not registered: its pages are misses", transfer.name)
            return None, ""
        return found

    # ---- lookups -------------------------------------------------------------------------------

    def _present(self, op: str, names: List[str], pin: bool) -> List[bool]:
        pin_s = self.settings.pin_seconds if pin else 0.0

        def ask(c: Any) -> List[bool]:
            out: List[bool] = []
            for chunk in batches(names, c.limits.max_batch):
                out += c.exists(chunk, pin_s=pin_s)
            return out

        return self._call(op, ask) or [False] * len(names)

    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many of `keys`, from the first, are stored; those are pinned for pin_seconds so the
        prefetch that follows finds them (an entry gone all the same is a miss there)."""
        present = self._present("batch_exists", list(keys), pin=True)
        return present.index(False) if False in present else len(present)

    def exists(self, key: str) -> bool:
        return self._present("exists", [key], pin=False)[0]

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[Any]] = None,
                        extra_info: Any = None) -> Any:
        """As SGLang's HiCacheFile: the longest KV prefix, cut by each sidecar pool's hit policy
        (ALL_PAGES: every page; TRAILING_PAGES: the last len(transfer.keys) pages of a prefix).
        BLOCK_GROUPS pools get no verdict (0 pages) and never gate the KV hit."""
        keys = list(keys)
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = transfer.name
            found = self._pool(name)
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                self._log.warning(f"exists_v2:{name}", "pool %s: hit policy block_groups is not supported: no pages",
                                  name)
                continue
            if found is None:
                has = [False] * kv_pages
            else:
                has = self._present("batch_exists_v2", [k + found[1] for k in keys[:kv_pages]], pin=True)
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {p for p in range(1, kv_pages + 1) if all(has[max(0, p - trailing):p])}
            else:  # ALL_PAGES
                boundary = has.index(False) if False in has else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            boundary = max(pool_restorable, default=0)
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    # ---- the generic tensor path --------------------------------------------------------------

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        keys = list(keys)
        values = list(values or [])
        if len(values) != len(keys) or any(not isinstance(v, torch.Tensor) for v in values):
            self._log.warning("batch_set:values", "batch_set: %d keys, values are not as many tensors", len(keys))
            return False
        if not self.is_writer:
            return True
        start = time.perf_counter()
        done = self._call("batch_set", lambda c: self._put_absent(c, keys, lambda i: values[i], start))
        if done is None:
            self._count(failed_pages=len(keys))
        return bool(done)

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """Each found entry copied into its target_locations tensor (SGLang passes flat dummy
        pages), or, without one, returned as a copy; None for a miss (the target untouched)."""
        keys = list(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            return [None] * len(keys)
        out: List[torch.Tensor | None] = [None] * len(keys)
        start = time.perf_counter()

        def copy(i: int, view: torch.Tensor) -> bool:
            target = targets[i]
            if target is None:
                out[i] = view.clone()
                return True
            if load_into(target, view):
                out[i] = target
                return True
            return False

        result = self._call("batch_get", lambda c: self._load(c, "batch_get", keys, copy))
        if result is None:
            self._count(failed_pages=len(keys))
            return [None] * len(keys)
        nbytes = sum(t.numel() * t.element_size() for t, ok in zip(out, result) if ok and t is not None)
        self._metric("prefetch", sum(result), nbytes, time.perf_counter() - start)
        self._count(loaded_bytes=nbytes)
        return [t if ok else None for t, ok in zip(out, result)]

    # ---- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> bool:
        """Remove this backend's namespace from the daemon (entries under a read lease or pin
        are left; the log says how many)."""
        done = self._call("clear", lambda c: c.evict(namespace=c.namespace))
        if done is None:
            log.warning("ecd hicache: clear: the daemon could not be reached; nothing removed")
            return False
        if done["refused"]:
            log.warning("ecd hicache: clear: %d entries in use were left", len(done["refused"]))
        log.info("ecd hicache: cleared %d entries of namespace %s", done["evicted"], self.namespace)
        return not done["refused"]

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GiB/s per prefetch and backup since the last call)
        when storage metrics are on, else None."""
        if not self.enable_metrics:
            return None
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # pragma: no cover - an SGLang without it
            return None
        with self._stats_lock:
            taken = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        return StorageMetrics(**taken)

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
