"""Processes for the submission chaos tests (test_submission_crashes.py).

  producer-killed ENDPOINT STAGE KEY  place one put by hand on the session's page, print "ready", and at a line on stdin SIGKILL
                                      itself at STAGE: "mid-copy" (half the bytes copied, no
                                      record), "no-seq" (bytes and record fields, no sequence
                                      number), "posted" (the whole record: committed at its end)
  hostile ENDPOINT                    post malformed records on its own page; prints, per case,
                                      the daemon's refusal (code and message) as JSON lines
  daemon MUTANT -- PYTHON -m ecd ...  run the daemon with a mutant or a kill point:
                                      kill-mid-carve:N  SIGKILL at the N-th carve, between the
                                                        lease's new intent and the entry's record
                                      no-bounds-check   accept a record's offset wherever it lies
"""
from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time

import torch


def _page(endpoint: str):
    from ecd import Client
    from ecd.client.testing import submission_page
    client = Client(endpoint, timeout=5.0)
    return client, submission_page(client)


def _write_body(page, put, flags: int = 0, nbytes: int | None = None, dtype: int | None = None,
                key: bytes | None = None, generation: int | None = None, offset: int | None = None,
                meta_length: int = 0) -> int:
    from ecd.writes.submission import MAX_NDIM, RECORD_BODY, record_offset
    at = record_offset(page.page_at, page.records, put.seq)
    key = put.key.encode() if key is None else key
    shape = put.shape + (0,) * (MAX_NDIM - len(put.shape))
    RECORD_BODY.pack_into(page.buf, at + 8, put.extent.generation if generation is None else generation,
                          put.extent.offset if offset is None else offset, put.nbytes if nbytes is None else nbytes,
                          0, flags, put.dtype if dtype is None else dtype, len(put.shape), len(key), meta_length, *shape, key)
    return at


def producer_killed(endpoint: str, stage: str, key: str) -> None:
    from ecd.client.testing import place_on_page
    from ecd.writes.submission import SEQ
    client, page = _page(endpoint)
    tensor = torch.full((16384,), 7.0)
    [put] = place_on_page(client, {key: tensor}, [tensor.numel() * 4], ["float32"])
    raw = tensor.view(torch.uint8).numpy()
    half = len(raw) // 2 if stage == "mid-copy" else len(raw)
    page.buf[put.extent.offset:put.extent.offset + half] = raw[:half].tobytes()
    if stage != "mid-copy":
        at = _write_body(page, put)
        if stage == "posted":
            SEQ.pack_into(page.buf, at, put.seq)
    print("ready", flush=True)
    sys.stdin.readline()  # the test looks at the daemon's leased bytes while this process still holds its lease
    os.kill(os.getpid(), signal.SIGKILL)


def hostile(endpoint: str) -> None:
    """Each case places one put (so the daemon expects its sequence number) and posts a bad record
    for it; the refusal read back from the page is printed."""
    from ecd.errors import EcdError
    from ecd.protocol import KVBlockMeta
    from ecd.client.testing import place_on_page
    from ecd.writes.submission import FLAGS_KNOWN, SEQ
    client, page = _page(endpoint)
    tensor = torch.ones(1024)
    cases = {
        "foreign-lease": dict(generation=1),
        "outside-lease": dict(offset=0),
        "misaligned": "misaligned",
        "unknown-dtype": dict(dtype=250),
        "bad-utf8": dict(key=b"\xff\xfe"),
        "unknown-flags": dict(flags=FLAGS_KNOWN + 8),
        "size-mismatch": dict(nbytes=100),
        "behind-the-front": "behind",
        "bad-meta": "bad-meta",
    }
    for name, change in cases.items():
        metas = {f"h-{name}": KVBlockMeta(1)} if change == "bad-meta" else None
        [put] = place_on_page(client, {f"h-{name}": tensor}, [4096], ["float32"], metas)
        if change == "bad-meta":  # room for a meta after the bytes, and garbage in it
            page.buf[put.extent.offset + 4096:put.extent.offset + 4106] = b"\xc1" * 10
            change = dict(meta_length=10)
        elif change == "misaligned":
            change = dict(offset=put.extent.offset + 8)
        elif change == "behind":
            change = dict(offset=put.extent.offset - 4096)  # the bytes of the previous (refused) record
        at = _write_body(page, put, **change)
        SEQ.pack_into(page.buf, at, put.seq)
        with page.lock:
            page.posted = max(page.posted, put.seq)
        try:
            page.flush(5.0)
            print(json.dumps({"case": name, "refused": None}), flush=True)
        except EcdError as exc:
            print(json.dumps({"case": name, "refused": type(exc).__name__, "message": str(exc)}), flush=True)
    client.put("after", tensor)  # the daemon still serves, and this client's page still works
    print(json.dumps({"case": "after", "ok": bool(torch.equal(client.get("after"), tensor))}), flush=True)
    client.close()


def apply_daemon_mutant(mutant: str) -> None:
    from ecd.daemon.writes import consumer, leases
    if mutant.startswith("kill-mid-carve:"):
        left = [int(mutant.split(":")[1])]
        real_carve = leases.Leasing.carve

        def carve(self, lease, offset, nbytes):
            old = real_carve(self, lease, offset, nbytes)  # the new intent is written
            left[0] -= 1
            if left[0] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)  # before the entry's record and the old intent's end
            return old

        leases.Leasing.carve = carve
    elif mutant == "no-bounds-check":
        real_settle = consumer.SubmissionArea.settle

        def settle(self, state, seq, fields):
            lease = self.leasing.find(state.session, fields[0])
            if lease is not None and fields[1] < lease.front:
                lease.front = fields[1]  # "in bounds" whatever it names
            return real_settle(self, state, seq, fields)

        consumer.SubmissionArea.settle = settle
    else:
        raise SystemExit(f"unknown mutant {mutant}")


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "producer-killed":
        producer_killed(*args)
    elif mode == "hostile":
        hostile(args[0])
    elif mode == "daemon":
        apply_daemon_mutant(args[0])
        command = args[args.index("--") + 1:]  # PYTHON -m ecd serve --config X
        sys.argv = ["ecd", *command[command.index("-m") + 2:]]
        time.sleep(0)
        runpy.run_module("ecd", run_name="__main__")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
