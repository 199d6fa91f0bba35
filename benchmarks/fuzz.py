#!/usr/bin/env python3
"""Protocol fuzzing at volume: `python benchmarks/fuzz.py --frames N [--seed S] [--json]`.

Starts its own daemon (bench_daemon.BenchDaemon), then sends N mixed frames from several DEALER
identities as fast as the daemon answers (each identity keeps a bounded window of requests in
flight): well-formed but adversarial requests (bad shapes, dtypes, sizes, generations of other
clients or of nobody, oversized keys and batches, unknown tags, wrong protocol versions, requests
before hello, fire-and-forget requests that must go unanswered) and raw garbage (random bytes,
random msgpack, empty and extra frames, and now and then a frame over limits.max_message_bytes,
which libzmq answers by closing that connection).

Reports replies by type and error code, frames the daemon dropped (its ecd_frames_dropped_total),
replies owed but never received, daemon crashes, and the daemon's memory before (after a
warm-up) and after. Exits 1 on a crash, a stall, a lost reply, an internal error, a bystander
whose leases were touched, or private memory (RssAnon) growing more than --max-growth-mib.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.request

import msgspec
import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_daemon import BenchDaemon, proc_memory_kib  # noqa: E402

from ecd.errors import Code  # noqa: E402
from ecd.protocol import (DTYPE_ITEMSIZE, PROTOCOL_VERSION, Abort, Acquire, Alloc, AllocItem,  # noqa: E402
                          Bye, Commit, Delete, Error, Evict, Exists, Extent, Failure, Held, Hello, Keys,
                          Location, Ping, Publish, PutInline, Release, Report, Stats, Unpin, encoder,
                          reply_decoder, request_decoder)
from ecd.daemon.control.loop import salvage_request_id  # noqa: E402

MAX_KEY = 1024
MAX_BATCH = 4096
MAX_MESSAGE = 1 << 20  # oversized frames are cheap to send at 1 MiB + 1
INLINE_MAX = 64 << 10
CONFIG = f"""
[leases]
max_wait = "200ms"
max_pin = "2s"
[limits]
max_key_bytes = {MAX_KEY}
max_batch = {MAX_BATCH}
max_message_bytes = {MAX_MESSAGE}
inline_max_bytes = {INLINE_MAX}
max_waiters_per_client = 8
max_leases_per_client = 64
"""
FUZZ_NS = ("fuzz-a", "fuzz-b", "", "x" * (MAX_KEY + 1))
KEYS = [f"k{i}" for i in range(48)] + ["", "y" * (MAX_KEY + 1), "é" * 600]
DTYPES = sorted(DTYPE_ITEMSIZE) + ["float", "torch.float32", "", "int3", "\x00"]
TAGS = ["ping", "alloc", "commit", "publish", "abort", "put_inline", "acquire", "release", "exists", "unpin",
        "delete", "stats", "keys", "evict", "held", "report", "nope", ""]
WINDOW = 16  # requests in flight per identity
STALL_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_dropped(port: int) -> dict[str, int]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    return {r: int(float(v)) for r, v in re.findall(r'^ecd_frames_dropped_total\{reason="(\w+)"\} (\S+)$',
                                                      body, re.M)}


class Generator:
    """Mixed adversarial frames from one seeded RNG. Returns (frames, owes_a_reply, reply_id)."""

    def __init__(self, rng: random.Random, bystander_gens: list[int]) -> None:
        self.rng = rng
        self.bystander_gens = bystander_gens
        self.decoder = request_decoder()
        self.big_keys = [f"b{i}" for i in range(MAX_BATCH * 2)]

    def gen(self) -> int:
        r = self.rng
        return r.choice([r.randrange(-2**63, 2**64), r.randrange(0, 5000), r.choice(self.bystander_gens)])

    def item(self) -> AllocItem:
        r = self.rng
        dtype = r.choice(DTYPES)
        shape = [r.choice([0, 1, 3, 64, 4096, 2**40]) for _ in range(r.choice([0, 1, 2, 3, 17]))]
        exact = DTYPE_ITEMSIZE.get(dtype, 0)
        for d in shape:
            exact *= d
        nbytes = r.choice([exact, exact, 0, exact + 1, 2**62, 1 << 20])
        return AllocItem(r.choice(KEYS), dtype, shape, min(nbytes, 2**63 - 1))

    def keys(self) -> list[str]:
        r = self.rng
        if r.random() < 0.002:
            return self.big_keys  # over max_batch
        return [r.choice(KEYS) for _ in range(r.randrange(0, 6))]

    def request(self, rid: int):
        r = self.rng
        kind = r.randrange(16)
        ns = r.choice(FUZZ_NS)
        if kind == 0:
            return Alloc(rid, ns, [self.item() for _ in range(r.randrange(0, 4))])
        if kind == 1:
            size = r.choice([0, 4, 16, 1024, INLINE_MAX + 1])
            return PutInline(rid, ns, r.choice(KEYS), r.choice(DTYPES), [size // 4 or 1], b"\x00" * size)
        if kind in (2, 3, 4):
            cls = (Commit, Abort, Release)[kind - 2]
            return cls(rid, [self.gen() for _ in range(r.randrange(0, 4))])
        if kind == 5:
            return Held(rid, [self.gen() for _ in range(r.randrange(0, 4))])
        if kind == 6:
            return Publish(rid, ns, self.gen(), self.item())
        if kind == 7:
            return Exists(rid, ns, self.keys(), r.choice([0.0, 0.0, 1.0, 1e9]))
        if kind == 8:
            return Acquire(rid, ns, self.keys(), r.choice([0.0, 0.0, 0.0, 0.01]))
        if kind == 9:
            return (Unpin, Delete)[r.randrange(2)](rid, ns, self.keys())
        if kind == 10:
            return Evict(rid, ns, self.keys(), whole_namespace=r.random() < 0.1)
        if kind == 11:
            return r.choice([Ping(rid), Stats(rid), Keys(rid, "", r.choice([1, 10]))])
        if kind == 12:
            return Hello(rid, r.choice([0, 2, 99, -1, 2**64 - 1]), os.getpid(), "fuzz")
        if kind == 13:  # fire-and-forget
            return r.choice([Release(0, [self.gen()]), Report(0, r.randrange(0, 3)), Ping(0),
                             Exists(0, ns, self.keys())])
        return None  # garbage

    def garbage(self) -> list[bytes]:
        r = self.rng
        kind = r.randrange(6)
        if kind == 0:
            return [r.randbytes(r.randrange(0, 200))]
        if kind == 1:
            return [b""]
        if kind == 2:
            fields = [r.choice([None, True, -1, 2**64 - 1, 1.5, "s", b"b", [], {}, [1, "x"], {"a": 1}])
                      for _ in range(r.randrange(0, 7))]
            return [encoder.encode([r.choice(TAGS), r.choice([r.randrange(1, 2**40), "id", None, -5]), *fields])]
        if kind == 3:
            return [r.randbytes(r.randrange(0, 40)) for _ in range(r.randrange(2, 5))]
        if kind == 4:
            return [r.choice([b"\x91", b"\xdd\xff\xff\xff\xff", b"\xc1", b"\x92\xa4ping", b"\xa2\xbc\x00",
                              b"\x9f" * 200])]
        return [encoder.encode(["ping", r.randrange(1, 2**40)]) + r.randbytes(r.randrange(1, 8))]

    @staticmethod
    def owes(msg) -> bool:
        """Id 0: never answered. Bye and Report (fire-and-forget whatever their id): never."""
        return msg.id != 0 and not isinstance(msg, (Bye, Report))

    def next(self, rid: int, registered: bool) -> tuple[list[bytes], bool, int]:
        msg = self.request(rid)
        if msg is not None:
            return [encoder.encode(msg)], self.owes(msg), msg.id
        frames = self.garbage()
        if len(frames) != 1:
            return frames, True, 0
        try:
            req = self.decoder.decode(frames[0])
        except Exception:
            return frames, True, salvage_request_id(frames[0])
        if isinstance(req, (Hello, Bye)):  # keep identities as they are
            return [encoder.encode(Ping(rid))], True, rid
        return frames, self.owes(req), req.id


class Identity:
    def __init__(self, ctx: zmq.Context, endpoint: str, registered: bool) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(endpoint)
        self.registered = registered
        self.outstanding: collections.Counter = collections.Counter()  # reply id -> count owed
        self.inflight = 0
        self.followups: list = []  # (class, generation): aborts of extents we got, releases of leases
        if registered:
            self.sock.send(encoder.encode(Hello(1, PROTOCOL_VERSION, os.getpid(), "fuzz")))
            self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
            assert reply_decoder().decode(self.sock.recv()).id == 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--identities", type=int, default=6, help="registered identities (plus 2 that never say hello)")
    ap.add_argument("--max-growth-mib", type=float, default=20.0)
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    workdir = tempfile.mkdtemp(prefix="ecd-fuzz-")
    port = free_port()
    daemon = BenchDaemon(workdir, node_prefix="fuzz", pool="64MiB", metrics=f"127.0.0.1:{port}", extra=CONFIG)
    result: dict = {"frames": args.frames, "seed": args.seed}
    ctx = zmq.Context()
    try:
        daemon.connect(timeout=5.0).close()  # waits until it serves
        result.update(run(args, rng, ctx, daemon, port))
    finally:
        rc = daemon.stop()
        ctx.destroy(0)
        if os.environ.get("ECD_FUZZ_KEEP"):
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    result["daemon_exit"] = rc
    failures = result.setdefault("failures", [])
    if rc != 0 and not result.get("crashes"):
        failures.append(f"daemon exited {rc} on SIGTERM")
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        report(result)
    return 1 if failures else 0


def run(args, rng: random.Random, ctx: zmq.Context, daemon: BenchDaemon, port: int) -> dict:
    decoder = reply_decoder()
    # A bystander with a read lease, a pin, a write in progress and a reservation.
    by = Identity(ctx, daemon.endpoint, registered=True)

    def ask(msg):
        by.sock.send(encoder.encode(msg))
        reply = decoder.decode(by.sock.recv())
        assert reply.id == msg.id, reply
        return reply
    assert ask(PutInline(2, "bystander", "held", "uint8", [64], b"\x07" * 64)).results == [None]
    (lease,) = ask(Acquire(3, "bystander", ["held"])).results
    assert ask(Exists(4, "bystander", ["held"], 1.0)).values == [True]
    (write,) = ask(Alloc(5, "bystander", [AllocItem("pending", "uint8", [100], 100)])).results
    (other,) = ask(Alloc(6, "bystander", [AllocItem("second", "uint8", [100], 100)])).results
    reservation = ask(Commit(7, [other.generation], reserve=4096)).reservation
    assert isinstance(lease, Location) and isinstance(write, Extent) and isinstance(reservation, Extent)
    bystander_gens = [lease.generation, write.generation, reservation.generation]

    gen = Generator(rng, bystander_gens)
    ids = [Identity(ctx, daemon.endpoint, registered=True) for _ in range(args.identities)]
    ids += [Identity(ctx, daemon.endpoint, registered=False) for _ in range(2)]
    poller = zmq.Poller()
    for ident in ids:
        poller.register(ident.sock, zmq.POLLIN)
    by_sock = {ident.sock: ident for ident in ids}

    replies = collections.Counter()
    foreign = collections.Counter()  # codes for generations of the bystander
    unexpected: list[str] = []
    next_id = 1 << 20
    sent = oversized = 0
    warmup = max(1000, args.frames // 10)
    before = None
    dropped_before = scrape_dropped(port)
    started = time.monotonic()
    pid = daemon.proc.pid
    crashes = 0
    stall = False

    def handle(ident: Identity, reply) -> None:
        key = reply.id
        if ident.outstanding.get(key, 0) <= 0:
            unexpected.append(f"{type(reply).__name__} id={reply.id}")
            return
        ident.outstanding[key] -= 1
        if not ident.outstanding[key]:
            del ident.outstanding[key]
        ident.inflight -= 1
        if isinstance(reply, Error):
            replies[f"error:{Code(reply.code).name}"] += 1
            return
        replies[type(reply).__name__] += 1
        for r in getattr(reply, "results", None) or []:
            if isinstance(r, Failure):
                replies[f"failure:{Code(r.code).name}"] += 1
            elif isinstance(r, Extent):
                ident.followups.append((Abort, r.generation))  # what a well-behaved client does
            elif isinstance(r, Location):
                ident.followups.append((Release, r.generation))
        reservation_ = getattr(reply, "reservation", None)
        if isinstance(reservation_, Extent):
            ident.followups.append((Abort, reservation_.generation))

    def send_followups(ident: Identity) -> None:
        nonlocal next_id
        while ident.followups:
            cls, generation = ident.followups.pop()
            ident.sock.send(encoder.encode(cls(next_id, [generation])))
            ident.outstanding[next_id] += 1
            ident.inflight += 1
            next_id += 1

    while True:
        if daemon.proc.poll() is not None:
            crashes += 1
            break
        for ident in ids:
            send_followups(ident)
            while ident.inflight < WINDOW and sent < args.frames:
                # now and then, a frame over max_message_bytes on a throwaway connection
                if rng.random() < 0.0005:
                    throwaway = ctx.socket(zmq.DEALER)
                    throwaway.setsockopt(zmq.LINGER, 0)
                    throwaway.connect(daemon.endpoint)
                    throwaway.send(b"\x00" * (MAX_MESSAGE + 1 + rng.randrange(1 << 20)))
                    throwaway.close(linger=1000)
                    oversized += 1
                    sent += 1
                    continue
                rid = next_id
                next_id += 1
                frames, owes, reply_id = gen.next(rid, ident.registered)
                ident.sock.send_multipart(frames)
                sent += 1
                if owes:
                    ident.outstanding[reply_id] += 1
                    ident.inflight += 1
                if sent == warmup:
                    before = proc_memory_kib(pid)
        if sent >= args.frames and all(i.inflight == 0 and not i.followups for i in ids):
            break
        events = dict(poller.poll(STALL_S * 1000))
        if not events:
            if daemon.proc.poll() is not None:
                crashes += 1
            else:
                stall = True
            break
        for sock in events:
            ident = by_sock[sock]
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    handle(ident, decoder.decode(frame))
                except msgspec.DecodeError as exc:
                    unexpected.append(f"undecodable reply: {exc}")
    elapsed = time.monotonic() - started
    result: dict = {"sent": sent, "oversized_frames": oversized, "seconds": round(elapsed, 2),
                    "frames_per_s": round(sent / elapsed), "replies": dict(sorted(replies.items())),
                    "crashes": crashes}
    failures = result["failures"] = []
    if crashes:
        failures.append(f"the daemon died (exit {daemon.proc.returncode}):\n{daemon.log_tail()}")
        return result
    lost = sum(sum(i.outstanding.values()) for i in ids)
    result["replies_lost"] = lost
    result["replies_unexpected"] = len(unexpected)
    if stall:
        failures.append(f"no reply for {STALL_S}s with {lost} owed")
    if lost:
        failures.append(f"{lost} replies never came")
    if unexpected:
        failures.append(f"{len(unexpected)} replies nobody asked for, e.g. {unexpected[:3]}")

    # The bystander's lease, write and reservation must be intact and out of others' reach.
    probe = ids[0]
    probe.sock.setsockopt(zmq.RCVTIMEO, 10_000)
    for msg in (Release(90, [lease.generation]), Commit(91, [write.generation]), Abort(92, [write.generation]),
                Commit(93, [reservation.generation]), Abort(94, [reservation.generation])):
        probe.sock.send(encoder.encode(msg))
        reply = decoder.decode(probe.sock.recv())
        foreign[Code(reply.results[0].code).name] += 1
    result["bystander_generations_refused"] = dict(foreign)
    if set(foreign) != {"NOT_OWNER"}:
        failures.append(f"another identity touched the bystander's leases: {dict(foreign)}")
    time.sleep(0.5)
    after = proc_memory_kib(pid)
    stats = ask(Stats(8)).stats
    if stats.read_leases != 1 or stats.entries_writing != 1 or stats.errors.get("unhandled") \
            or stats.errors.get("internal"):
        failures.append(f"bystander or books not as expected: read_leases={stats.read_leases} "
                        f"writing={stats.entries_writing} errors={stats.errors}")
    (again,) = ask(Acquire(9, "bystander", ["held"])).results
    if not isinstance(again, Location) or again.generation != lease.generation:
        failures.append(f"the bystander's entry is gone: {again}")
    dropped_after = scrape_dropped(port)
    result["dropped_by_daemon"] = {k: v - dropped_before.get(k, 0) for k, v in dropped_after.items()}
    result["daemon_errors"] = dict(sorted(stats.errors.items()))
    result["sessions"] = stats.clients
    before = before or after
    result["rss_kib_before"], result["rss_kib_after"] = before, after
    growth = {k: after[k] - before[k] for k in after}
    result["rss_kib_growth"] = growth
    if growth["RssAnon"] > args.max_growth_mib * 1024:
        failures.append(f"daemon private memory grew {growth['RssAnon'] / 1024:.1f} MiB after warm-up")
    for ident in ids + [by]:
        ident.sock.send(encoder.encode(Bye(0)))
    return result


def report(r: dict) -> None:
    print(f"fuzz: {r.get('sent', 0)} frames ({r.get('oversized_frames', 0)} over max_message_bytes) in "
          f"{r.get('seconds', 0)} s = {r.get('frames_per_s', 0)} frames/s, seed {r['seed']}")
    print(f"crashes: {r.get('crashes', 0)}   replies lost: {r.get('replies_lost', 0)}   "
          f"unexpected: {r.get('replies_unexpected', 0)}   daemon exit on SIGTERM: {r.get('daemon_exit')}")
    print("replies (and per-item failures) by type/code:")
    for k, v in r.get("replies", {}).items():
        print(f"  {k:28s} {v:>8d}")
    print(f"dropped by the daemon (ecd_frames_dropped_total): {r.get('dropped_by_daemon')}")
    print(f"bystander generations tried by others: {r.get('bystander_generations_refused')}")
    if "rss_kib_before" in r:
        b, a, g = r["rss_kib_before"], r["rss_kib_after"], r["rss_kib_growth"]
        for k in ("VmRSS", "RssAnon", "RssShmem"):
            print(f"  {k:9s} before {b[k] / 1024:7.1f} MiB  after {a[k] / 1024:7.1f} MiB  delta {g[k] / 1024:+6.1f} MiB")
    print("PASS" if not r["failures"] else "FAIL:\n  " + "\n  ".join(r["failures"]))


if __name__ == "__main__":
    sys.exit(main())
