"""The fleet directory's layout in Redis or Valkey, and the only code that reads or writes it.

Synchronous redis-py, used from the directory's own threads (directory.py) and by benchmarks and
tests, which read the same names straight from the store (`live_nodes`, `holders`). Every name
starts with `[cluster] directory_prefix` (PREFIX below), so fleets can share one store:

  PREFIX:nodes          sorted set: node name -> the UNIX time (the store's clock) its
                        registration expires. Live = score > now: one ZRANGEBYSCORE.
  PREFIX:node:NAME      hash: the node's record (RECORD_FIELDS and updated_at), with the same TTL
  PREFIX:k:MEMBER       set: names of the nodes holding the entry MEMBER = "LEN(ns):ns:key"
  PREFIX:held:NAME      set: the MEMBERs node NAME registered (a resync diffs it; a dead node's
                        entries are taken out of the key sets through it)

Time is the store's (`TIME` inside the scripts), so the nodes' clocks need not agree. A
registration (REGISTER: one round trip) renews the node, prunes the members that expired and
returns the live nodes with their epochs; the one call that pruned a node (ZREM answers once)
then takes its entries out of the key sets (forget_node). Lookups (LOOKUP: one round trip) return
each key's holders that are live now.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# What a node publishes about itself (all strings in the hash); updated_at is the store's time.
RECORD_FIELDS = ("node", "endpoint", "data", "transport", "curve", "capacity", "used", "health", "epoch",
                 "version")

_REGISTER = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local fresh = redis.call('EXISTS', KEYS[2]) == 0
redis.call('HSET', KEYS[2], 'updated_at', string.format('%.3f', now), unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[2], math.floor(ttl * 1000))
redis.call('ZADD', KEYS[1], string.format('%.3f', now + ttl), ARGV[2])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.3f', now))
for _, name in ipairs(dead) do redis.call('ZREM', KEYS[1], name) end
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%.3f', now), '+inf')
local epochs = {}
for i, name in ipairs(live) do epochs[i] = redis.call('HGET', ARGV[3] .. name, 'epoch') or '' end
return {fresh and 1 or 0, dead, live, epochs}
"""

_LOOKUP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i, name in ipairs(KEYS) do
  local live = {}
  for _, node in ipairs(redis.call('SMEMBERS', name)) do
    local score = redis.call('ZSCORE', ARGV[1], node)
    if score and tonumber(score) > now then live[#live + 1] = node end
  end
  out[i] = live
end
return out
"""

_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. string.format('%.3f', now), '+inf')
"""

BATCH = 1000  # commands per pipeline (a resync's, a cleanup's)


def member(ns: str, key: str) -> str:
    """(ns, key) as one unambiguous string: the length of ns, then both."""
    return f"{len(ns)}:{ns}:{key}"


def split_member(text: str) -> tuple[str, str]:
    size, _, rest = text.partition(":")
    n = int(size)
    return rest[:n], rest[n + 1:]


def read_password(path: str) -> tuple[str | None, str]:
    """directory_password_file: "PASSWORD", or "USERNAME PASSWORD" (a Redis ACL user); ValueError
    saying why not. Returns (username or None, password)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    parts = text.split()
    if len(parts) not in (1, 2) or "\n" in text:
        raise ValueError(f"{path} must hold one line: PASSWORD, or USERNAME PASSWORD")
    return (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])


def password_file_open(path: str) -> bool:
    """Whether group or others may read the password file (the daemon warns, as for key files)."""
    try:
        return bool(os.stat(path).st_mode & 0o077)
    except OSError:
        return False


def connect(url: str, timeout: float, username: str | None = None, password: str | None = None) -> redis.Redis:
    """A client for `url` that fails fast: one try per command (the directory retries itself, with
    backoff), `timeout` to connect and per command."""
    return redis.Redis.from_url(url, username=username, password=password, socket_timeout=timeout,
                                socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0), decode_responses=True,
                                health_check_interval=0, client_name="ecd")


class DirectoryStore:
    """One fleet's names (its prefix) in one store, through `client`."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.nodes = f"{prefix}:nodes"
        self._register = client.register_script(_REGISTER)
        self._lookup = client.register_script(_LOOKUP)
        self._live = client.register_script(_LIVE)

    def node_key(self, name: str) -> str:
        return f"{self.prefix}:node:{name}"

    def held_key(self, name: str) -> str:
        return f"{self.prefix}:held:{name}"

    def key_set(self, text: str) -> str:
        return f"{self.prefix}:k:{text}"

    def register(self, name: str, ttl: float, record: dict[str, str]) -> tuple[bool, list[str], dict[str, str]]:
        """Renew `name` for `ttl` seconds with `record`: (fresh: there was no record, the nodes
        this call pruned, the live nodes -> their epochs)."""
        args: list[Any] = [f"{ttl:.3f}", name, f"{self.prefix}:node:"]
        for field, value in record.items():
            args += [field, value]
        fresh, dead, live, epochs = self._register(keys=[self.nodes, self.node_key(name)], args=args)
        return bool(fresh), list(dead), dict(zip(live, epochs))

    def records(self, names: Iterable[str]) -> dict[str, dict[str, str]]:
        """Each node's record (one pipelined round trip); an expired one is left out."""
        names = list(names)
        if not names:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.node_key(name))
        return {name: rec for name, rec in zip(names, pipe.execute()) if rec}

    def live(self) -> list[str]:
        return list(self._live(keys=[self.nodes]))

    def held(self, name: str) -> set[str]:
        """The members node `name` has registered (SSCAN, in pages)."""
        return set(self.client.sscan_iter(self.held_key(name), count=BATCH))

    def apply(self, name: str, changes: Iterable[tuple[bool, str]]) -> int:
        """Register (True) or withdraw (False) members for node `name`, BATCH commands a round
        trip; returns the commands sent."""
        held = self.held_key(name)
        pipe = self.client.pipeline(transaction=False)
        sent = 0
        for add, text in changes:
            if add:
                pipe.sadd(self.key_set(text), name)
                pipe.sadd(held, text)
            else:
                pipe.srem(self.key_set(text), name)
                pipe.srem(held, text)
            sent += 2
            if len(pipe) >= BATCH:
                pipe.execute()
        if len(pipe):
            pipe.execute()
        return sent

    def forget_node(self, name: str) -> int:
        """A dead node's entries out of the key sets, and its record and held set deleted;
        returns the commands sent. Safe to repeat (another node may do it at the same time)."""
        texts = self.held(name)
        pipe = self.client.pipeline(transaction=False)
        for text in texts:
            pipe.srem(self.key_set(text), name)
            if len(pipe) >= BATCH:
                pipe.execute()
        pipe.delete(self.held_key(name))
        pipe.execute()
        return len(texts) + 2

    def leave(self, name: str) -> None:
        """A clean stop: the node expires now (the next registration of any node prunes it and
        forgets its entries)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(self.nodes, {name: 0})
        pipe.delete(self.node_key(name))
        pipe.execute()

    def lookup(self, ns: str, keys: list[str]) -> list[list[str]]:
        """Per key, the live nodes holding it (one round trip)."""
        if not keys:
            return []
        return [list(x) for x in self._lookup(keys=[self.key_set(member(ns, k)) for k in keys], args=[self.nodes])]


def live_nodes(client: redis.Redis, prefix: str = "ecd") -> list[str]:
    """The live node names of fleet `prefix` (for benchmarks and tests)."""
    return DirectoryStore(client, prefix).live()


def holders(client: redis.Redis, ns: str, keys: list[str], prefix: str = "ecd") -> list[list[str]]:
    """Per key, the live nodes of fleet `prefix` that hold it (for benchmarks and tests)."""
    return DirectoryStore(client, prefix).lookup(ns, keys)
