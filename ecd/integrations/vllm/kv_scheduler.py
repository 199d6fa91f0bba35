"""The scheduler side of EcdKVConnector (kv_connector.py): which blocks of a request ecd holds,
and, each step, which of them the workers load and which new ones they save.

One batched `exists` per lookup gives the longest run of present blocks after the local
prefix-cache hit (never the prompt's last token), answered from the client's event ring and
location cache (a round trip only for keys the ring cannot vouch for). The blocks a step loads are
pinned until their request finishes (lazy_client.StepPins: one message per step that nobody
waits for, sent from `build_connector_meta`, the unpins of finished requests with it): the
scheduler, whose time is every request's time to first token, waits on the daemon only for what
the ring cannot answer. A block evicted between the lookup and its pin (the rest of that
scheduling pass) fails its load and is recomputed (kv_load_failure_policy "recompute"), as any
lost block is.
`build_connector_meta` names the blocks to load (into which block ids) and the new full prompt
blocks to save. Across nodes (kv_peers.py): a producer asked `do_remote_decode` answers from
`request_finished` with transfer params naming its daemon and the blocks it holds; a consumer
given them (or with `fetch_from_peers`) has its daemon pull the blocks it lacks on a connector
thread while the lookup answers "not decided yet", then loads them as local ones.

Every failure is caught, logged (rate-limited) and becomes a miss or a skipped save.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .kv_peers import PeerPulls, remote_source
from .lazy_client import LazyClient, StepPins, batches
from .metadata import (NULL_BLOCK_ID, BlockTransfer, EcdKVConnectorMetadata, GroupBlocks, KVGroup, KVGroups,
                       block_keys, block_meta, hybrid_hit_end, rank_keys, world_size)
from .ratelimit import RateLimitedLog, connector_logger
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = connector_logger("kv_connector")  # the connector's logger, shared by its two sides


@dataclass
class _RequestState:
    request: Any  # vllm Request (the scheduler's own object; its block_hashes grow with it)
    keys: list[str]  # one per full block of the request's tokens, at lookup time
    present: list[bool]  # per key: in ecd at lookup time
    start_block: int  # blocks below this were a local prefix-cache hit
    load: BlockTransfer | None = None  # planned by update_state_after_alloc, sent once
    block_ids: list[int] = field(default_factory=list)
    next_save: int = 0  # blocks below this were saved or skipped already
    groups: list[GroupBlocks] | None = None  # hybrid models: each KV cache group's blocks
    group_loads: list[BlockTransfer] = field(default_factory=list)  # hybrid: planned, sent once


class EcdKVConnectorScheduler:
    """The scheduler-side methods of EcdKVConnector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", settings: ConnectorSettings, per_block: int,
                 client: LazyClient, log: RateLimitedLog, groups: KVGroups | None = None) -> None:
        """`per_block`: vLLM's block hashes per paged block (metadata.hashes_per_block);
        `groups`: vLLM's KV cache groups (metadata.kv_groups; None: one group)."""
        transfer = vllm_config.kv_transfer_config
        self.settings = settings
        self.client = client
        self._log = log
        self._block_size = vllm_config.cache_config.block_size
        self._hashes_per_block = per_block
        self._loads_enabled = transfer.is_kv_consumer
        self._saves_enabled = transfer.is_kv_producer
        self._world = world_size(vllm_config)
        self._groups = groups or KVGroups([KVGroup(0, ())])
        if self._groups.unsupported is not None:
            logger.warning("ecd kv connector: %s: nothing is loaded or saved for this model",
                           self._groups.unsupported)
            self._loads_enabled = self._saves_enabled = False
        self._requests: dict[str, _RequestState] = {}
        self._failed_loads: set[str] = set()  # hybrid: requests whose load failed: recomputed
        self._pins = StepPins(client, settings.pin_seconds)  # req_id -> rank keys its loads pin
        self._peers = PeerPulls(client, settings, log, logger)  # across nodes
        if self._loads_enabled and getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("ecd kv connector: kv_load_failure_policy is %r: a block evicted or lost "
                           "between lookup and load fails its request instead of being recomputed; "
                           "set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config",
                           transfer.kv_load_failure_policy)

    def _block_keys(self, request: "Request") -> list[str]:
        return block_keys(request, self._block_size, self._hashes_per_block)

    # ---- lookup ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            if self._loads_enabled and self._fetching(request, num_computed_tokens):
                return None, False  # blocks on their way from a peer: vLLM asks again next step
            matched = self._match(request, num_computed_tokens)
            # Several KV cache groups: the load is asynchronous (vLLM takes a failed load back
            # only as a failed request then: _match_groups' docstring).
            return matched, bool(matched) and self._groups.hybrid
        except Exception as exc:  # never out of the connector: a miss
            self._log.warning("lookup", "lookup for %s failed: %s: %s", request.request_id,
                              type(exc).__name__, exc)
            return 0, False

    def _fetching(self, request: "Request", num_computed_tokens: int) -> bool:
        """Whether this request waits for blocks being pulled from a peer. The first call starts
        the pull (when the request names a producer on another node, or fetch_from_peers is on
        and blocks are missing here); later calls answer until it settles (done, or its deadline
        passed). Once settled, never again for this request."""
        req_id = request.request_id
        waiting = self._peers.waiting(req_id)
        if waiting is not None:
            return waiting
        self._peers.settle(req_id)  # settled unless a pull starts below
        if getattr(request, "skip_reading_prefix_cache", False):
            return False
        source = remote_source(getattr(request, "kv_transfer_params", None))
        if source is None and not self.settings.fetch_from_peers:
            return False
        bs = self._block_size
        keys = self._block_keys(request)
        loadable = min(len(keys), (request.num_tokens - 1) // bs)
        peer: str | None = None
        if source is not None:
            peer, blocks, last = source
            if blocks <= 0 or blocks > len(keys) or keys[blocks - 1] != last:
                self._log.warning("fetch-params", "request %s: the producer's blocks (%d, last %s) are not "
                                  "this engine's (other model, namespace or block size?): not fetched",
                                  req_id, blocks, last[:16])
                return False
            loadable = min(loadable, blocks)
            if peer in self._peers.identity():
                return False  # the producer shares our daemon: a local lookup finds them
        wanted = self._all_rank_keys(self._group_keys(keys[num_computed_tokens // bs:loadable]))
        if not wanted:
            return False
        local = self.client.call("exists", lambda c: c.exists(wanted))
        missing = [k for k, hit in zip(wanted, local or [False] * len(wanted)) if not hit]
        if local is None or not missing:
            return False  # no daemon (a miss anyway) or all here already
        self._peers.start(req_id, missing, peer)
        return True

    def _match(self, request: "Request", num_computed_tokens: int) -> int:
        bs = self._block_size
        keys = self._block_keys(request) if self._loads_enabled or self._saves_enabled else []
        # The last token is always computed here (vLLM needs its logits): at most num_tokens - 1.
        loadable = min(len(keys), (request.num_tokens - 1) // bs) if self._loads_enabled else 0
        wanted = min(len(keys), max(loadable, request.num_prompt_tokens // bs))
        keys = keys[:wanted]
        start = num_computed_tokens // bs
        if self._groups.hybrid:
            return self._match_groups(request, keys, start, loadable)
        present = [False] * len(keys)
        if keys and not getattr(request, "skip_reading_prefix_cache", False):
            present = self._lookup(keys)
        self._requests[request.request_id] = _RequestState(request, keys, present, start)
        end = start
        while end < loadable and present[end]:
            end += 1
        return (end - start) * bs if end > start else 0

    def _lookup(self, keys: list[str]) -> list[bool]:
        """One batched exists over every block's keys (the ring answers most); False for all on
        failure."""
        asked = self._all_rank_keys(keys)

        def exists(client) -> list[bool]:
            found: list[bool] = []
            for chunk in batches(asked, client.limits.max_batch):
                found.extend(client.exists(chunk))
            return found

        found = self.client.call("exists", exists)
        if found is None:
            return [False] * len(keys)
        per = len(asked) // len(keys) if keys else 1
        return [all(found[i * per:(i + 1) * per]) for i in range(len(keys))]

    # ---- planning a step ----

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        try:
            state = self._requests.get(request.request_id)
            if state is None:
                return
            state.load = None
            state.group_loads = []
            if num_external_tokens <= 0 or not self._loads_enabled:
                return
            if state.groups is not None:
                self._plan_groups(state, blocks, num_external_tokens)
                return
            (block_ids, *_) = blocks.get_block_ids()
            count = -(-num_external_tokens // self._block_size)
            first = state.start_block
            ids = list(block_ids[first:first + count])
            keys = state.keys[first:first + len(ids)]
            if len(keys) < len(ids) or len(ids) < count:
                self._log.warning("plan", "%s: %d blocks to load from block %d, but it has %d keys and "
                                  "%d blocks", request.request_id, count, first, len(state.keys), len(block_ids))
                keys += [""] * (len(ids) - len(keys))  # no key: the worker reports a load error
            state.load = BlockTransfer(request.request_id, keys, ids)
            self._pins.hold(request.request_id, self._all_rank_keys([key for key in keys if key]))
        except Exception as exc:
            self._log.warning("plan", "planning the load of %s failed: %s: %s", request.request_id,
                              type(exc).__name__, exc)

    def _all_rank_keys(self, keys: list[str]) -> list[str]:
        """Every worker's entry of each block (the keys themselves with one worker)."""
        if self._world == 1:
            return keys
        return [k for key in keys for k in rank_keys(key, self._world)]

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> EcdKVConnectorMetadata:
        meta = EcdKVConnectorMetadata()
        try:
            self._build(scheduler_output, meta)
        except Exception as exc:  # keep what was planned; a failure is a skipped save
            self._log.warning("meta", "building the step's metadata failed: %s: %s", type(exc).__name__, exc)
        # The step's pins in one message, not waited for: it reaches the daemon before the
        # workers ask for the blocks (and their read leases hold them while they copy).
        self._pins.flush()
        return meta

    def _build(self, out: "SchedulerOutput", meta: EcdKVConnectorMetadata) -> None:
        if self._groups.hybrid:
            self._build_groups(out, meta)
            return
        scheduled: list[tuple[_RequestState, int]] = []
        for new in out.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0]) if new.block_ids else []
                scheduled.append((state, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            scheduled.append((state, cached.num_computed_tokens[i]))
        bs = self._block_size
        for state, computed in scheduled:
            req_id = state.request.request_id
            if state.load is not None:
                meta.loads.append(state.load)
                state.load = None
            if not self._saves_enabled:
                continue
            # Blocks whose KV exists once this step ran: the prompt's full blocks only.
            done = computed + out.num_scheduled_tokens.get(req_id, 0)
            full = min(done, state.request.num_prompt_tokens) // bs
            full = min(full, len(state.keys), len(state.block_ids))
            keys, ids, blocks = [], [], []
            for b in range(state.next_save, full):
                if not state.present[b] and state.block_ids[b] != NULL_BLOCK_ID:
                    keys.append(state.keys[b])
                    ids.append(state.block_ids[b])
                    blocks.append(block_meta(state.request, b, state.keys[b], bs, self._hashes_per_block))
                    state.present[b] = True
            state.next_save = max(state.next_save, full)
            if keys:
                meta.saves.append(BlockTransfer(req_id, keys, ids, blocks))

    # ---- after a step, and at the end ----

    def update_connector_output(self, connector_output: Any) -> None:
        """Blocks that failed to load are recomputed by vLLM: save them again once they are."""
        try:
            self._failed_loads.update(getattr(connector_output, "failed_recving", None) or ())
            invalid = getattr(connector_output, "invalid_block_ids", None)
            if not invalid:
                return
            for state in self._requests.values():
                for held in state.groups or ():
                    for b, block_id in enumerate(held.block_ids[:len(held.keys)]):
                        if block_id in invalid and block_id != NULL_BLOCK_ID:
                            held.present[b] = False
                            held.next_save = min(held.next_save, b)
                for b, block_id in enumerate(state.block_ids[:len(state.keys)]):
                    if block_id in invalid:
                        state.present[b] = False
                        state.next_save = min(state.next_save, b)
        except Exception as exc:
            self._log.warning("output", "handling the workers' output failed: %s: %s", type(exc).__name__, exc)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # the ignore: dict.pop takes any key at run time; a request without an id finds nothing
        req_id = getattr(request, "request_id", None)
        state = self._requests.pop(req_id, None)  # type: ignore[arg-type]
        self._peers.forget(req_id)
        self._failed_loads.discard(req_id)  # type: ignore[arg-type]
        if req_id is not None:
            self._pins.release(req_id)  # sent with the next step, or by itself if none comes soon
        try:
            params = self._transfer_params(request, state)
        except Exception as exc:  # never out of the connector: the decode side recomputes
            self._log.warning("params", "no kv_transfer_params for %s: %s: %s", req_id, type(exc).__name__, exc)
            params = None
        return False, params  # saves finish inside the step (wait_for_save): free the blocks now

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator's request_finished (SupportsHMA): every group's blocks are
        saved inside their step, so nothing is held past this call either."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def _transfer_params(self, request: "Request", state: _RequestState | None) -> dict[str, Any] | None:
        """A producer's answer to `do_remote_decode`: where the request's blocks are."""
        asked = getattr(request, "kv_transfer_params", None)
        if not (self._saves_enabled and isinstance(asked, dict) and asked.get("do_remote_decode")):
            return None
        if state is None:
            return None
        blocks = 0
        while blocks < min(state.next_save, len(state.keys)) and state.present[blocks]:
            blocks += 1
        return self._peers.transfer_params(blocks, state.keys[blocks - 1] if blocks else "")

    # ---- hybrid models: several KV cache groups (metadata.KVGroups) ----

    def _group_keys(self, keys: list[str]) -> list[str]:
        """Every group's key of each block (the keys themselves with a single group)."""
        return self._groups.keys(keys) if self._groups.hybrid else keys

    def _match_groups(self, request: "Request", keys: list[str], start: int, loadable: int) -> int:
        """_match for several groups: one batched exists over every group's key of every block;
        a hit ends where every group holds what the tokens after it need (hybrid_hit_end).

        vLLM (0.32, 0.33) cannot take a failed block back from a model with several groups
        (invalid_block_ids raises there: block ids are per group), only a failed request of an
        asynchronous load (failed_recving: it recomputes the whole request). So a hybrid hit is
        loaded asynchronously: the request waits one step while the workers load (in
        start_load_kv) and report it done or failed; a request whose load failed is a miss from
        then on (recomputed, never loaded from garbage)."""
        groups = self._groups.groups
        present = [False] * (len(keys) * len(groups))
        if keys and not getattr(request, "skip_reading_prefix_cache", False):
            present = self._lookup(self._group_keys(keys))
        held = [GroupBlocks([self._groups.key(k, g.index) for k in keys], present[i::len(groups)])
                for i, g in enumerate(groups)]
        state = _RequestState(request, keys, [all(p) for p in zip(*(h.present for h in held))], start, groups=held)
        self._requests[request.request_id] = state
        if request.request_id in self._failed_loads:
            return 0
        end = hybrid_hit_end(self._groups, held, start, loadable, self._block_size) if self._loads_enabled else start
        return (end - start) * self._block_size

    def _plan_groups(self, state: _RequestState, blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """update_state_after_alloc for several groups: each group loads the blocks vLLM gave it
        (a sliding window's blocks outside the window are the null block: not loaded). A block
        ecd did not report present gets no key: the worker reports it as a load error."""
        per_group = blocks.get_block_ids()
        first = state.start_block
        count = -(-num_external_tokens // self._block_size)
        pins: list[str] = []
        for group, held in zip(self._groups.groups, state.groups or ()):
            allocated = per_group[group.index][first:first + count]
            blocks_ = [b for b, i in zip(range(first, first + count), allocated) if i != NULL_BLOCK_ID]
            ids = [allocated[b - first] for b in blocks_]
            keys = [held.keys[b] if b < len(held.keys) and held.present[b] else "" for b in blocks_]
            if len(allocated) < count or "" in keys:
                self._log.warning("plan", "%s: group %d: %d of %d blocks to load from block %d are not in ecd",
                                  state.request.request_id, group.index, keys.count(""), len(keys), first)
            if ids:
                state.group_loads.append(BlockTransfer(state.request.request_id, keys, ids, group=group.index))
            pins.extend(k for k in keys if k)
        self._pins.hold(state.request.request_id, self._all_rank_keys(pins))

    def _build_groups(self, out: "SchedulerOutput", meta: EcdKVConnectorMetadata) -> None:
        """_build for several groups: each group's new block ids, its loads, and the saves of its
        full prompt blocks that are allocated (not the null block of a sliding window)."""
        scheduled: list[tuple[_RequestState, int]] = []
        for new in out.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None and state.groups is not None:
                for group, held in zip(self._groups.groups, state.groups):
                    held.block_ids = list(new.block_ids[group.index]) if new.block_ids else []
                scheduled.append((state, new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None or state.groups is None:
                continue
            new_ids = cached.new_block_ids[i]
            for group, held in zip(self._groups.groups, state.groups):
                if req_id in cached.resumed_req_ids:
                    held.block_ids = list(new_ids[group.index]) if new_ids else []
                elif new_ids:
                    held.block_ids.extend(new_ids[group.index])
            scheduled.append((state, cached.num_computed_tokens[i]))
        for state in self._requests.values():  # waiting for their (asynchronous) load, or scheduled
            meta.loads.extend(state.group_loads)
            state.group_loads = []
        bs = self._block_size
        for state, computed in scheduled:
            req_id = state.request.request_id
            if not self._saves_enabled or state.groups is None:
                continue
            done = computed + out.num_scheduled_tokens.get(req_id, 0)
            for group, held in zip(self._groups.groups, state.groups):
                full = min(min(done, state.request.num_prompt_tokens) // bs, len(held.keys), len(held.block_ids))
                keys, ids, about = [], [], []
                for b in range(held.next_save, full):
                    if not held.present[b] and held.block_ids[b] != NULL_BLOCK_ID:
                        keys.append(held.keys[b])
                        ids.append(held.block_ids[b])
                        about.append(block_meta(state.request, b, state.keys[b], bs, self._hashes_per_block,
                                                group.index))
                        held.present[b] = True
                held.next_save = max(held.next_save, full)
                if keys:
                    meta.saves.append(BlockTransfer(req_id, keys, ids, about, group=group.index))
            # what _transfer_params reports: the blocks every full attention group holds (a
            # consumer's lookup needs only the window of a sliding-window group)
            full = [h for g, h in zip(self._groups.groups, state.groups) if g.sliding_window is None]
            state.present = [all(p) for p in zip(*(h.present for h in full or state.groups))]
            state.next_save = min(h.next_save for h in full or state.groups)

    def shutdown(self) -> None:
        self._peers.shutdown()
        self._pins.close()
        self.client.close()
