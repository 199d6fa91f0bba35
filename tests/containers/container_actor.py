"""A client of ecd that runs inside a container, driven line by line by tests/containers.

Run as `python -c "$(cat container_actor.py)" ENDPOINT [control]` (the test passes its text on
the command line, so nothing of the host but the socket directory is mounted into the client's
container). One command per stdin line, one JSON reply per stdout line:

    connect TIMEOUT            -> {"ok": true, "session": ...} or {"ok": false, "error", "message"}
    ns                         -> this process's namespaces (inode links), uid, gid, groups
    put KEY NBYTES SEED        -> {"ok": true}
    get KEY NBYTES SEED        -> {"ok": true, "equal": bool}   (byte-exact against the pattern)
    view KEY NBYTES SEED       -> {"ok": true, "equal": bool, "mapping": the file /proc/self/maps
                                   names for the view's address, "copy_mapping": the same for get}
    timed-put KEY NBYTES SEED / timed-view KEY -> {"ok": true, "seconds": the call alone}
    hold KEY                   -> a view kept open (a read lease) until the process dies
    pin KEY SECONDS            -> exists(pin_s=SECONDS): a pin held by this session
    delete KEY | stats         -> {"ok": true, "result": ...}
    churn put|get|exists KEY NBYTES -> a thread putting (getting and checking, looking up) KEY
    report / mark              -> the churn's counts (since the last mark too) / start a new mark
With `control` it uses ecd.ControlClient (no torch, no pool mappings): the daemon-side observer.
"""
import contextlib
import json
import os
import sys
import threading
import time

ENDPOINT = sys.argv[1]
CONTROL_ONLY = len(sys.argv) > 2 and sys.argv[2] == "control"
client = None
holds = contextlib.ExitStack()
churn = {"ok": 0, "ok_since_mark": 0, "errors": {}, "errors_since_mark": {}, "bad": 0, "last_error": ""}
churn_lock = threading.Lock()


def reply(**fields):
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def pattern(nbytes, seed):
    import torch
    return ((torch.arange(nbytes, dtype=torch.int32) * 7 + seed) % 251).to(torch.uint8)


def mapping_of(address):
    """The file (or [anon]) /proc/self/maps names for the mapping holding `address`."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) > 5 else "[anon]"
    return "[unmapped]"


def count(kind):
    with churn_lock:
        for field in ("errors", "errors_since_mark"):
            churn[field][kind] = churn[field].get(kind, 0) + 1


def churn_loop(role, key, nbytes):
    """Put (role put) or get and check (role get) `key` until the process ends, through every
    daemon restart: each error is counted and the next call simply goes on (the client
    reconnects by itself). The first 8 bytes carry a counter the rest of the pattern derives from,
    so a torn or stale-mixed read shows as `bad`."""
    import torch
    from ecd import DaemonUnavailable, EcdError, KeyNotFound
    i = 0
    while True:
        i += 1
        try:
            if role == "put":
                data = pattern(nbytes, i % 251)
                data[:8] = torch.tensor([i], dtype=torch.int64).view(torch.uint8)
                client.put(key, data)
            elif role == "exists":  # a control operation: no pool mapping needed
                if client.exists(key) is not True:
                    raise KeyNotFound(key)
            else:
                got = client.get(key)
                seq = int(got[:8].view(torch.int64)[0])
                want = pattern(nbytes, seq % 251)
                if not torch.equal(got[8:], want[8:]):
                    with churn_lock:
                        churn["bad"] += 1
                    continue
            with churn_lock:
                churn["ok"] += 1
                churn["ok_since_mark"] += 1
        except KeyNotFound:
            count("KeyNotFound")  # a restarted daemon is empty until the producer puts again
        except DaemonUnavailable as e:
            count("DaemonUnavailable")
            churn["last_error"] = str(e)
        except EcdError as e:
            count(type(e).__name__)
            churn["last_error"] = f"{type(e).__name__}: {e}"
        time.sleep(0.02)


def handle(words):
    global client
    cmd = words[0]
    if cmd == "connect":
        import ecd
        cls = ecd.ControlClient if CONTROL_ONLY else ecd.Client
        try:
            client = cls(ENDPOINT, timeout=float(words[1]))
            client.ping()  # a refused hello (admission) shows here at the latest
        except ecd.EcdError as e:
            return reply(ok=False, error=type(e).__name__, message=str(e))
        return reply(ok=True, session=getattr(client, "_session", 0))
    if cmd == "ns":
        links = {n: os.readlink(f"/proc/self/ns/{n}") for n in ("pid", "ipc", "mnt", "net", "user")}
        return reply(ok=True, ns=links, uid=os.getuid(), gid=os.getgid(), groups=sorted(os.getgroups()),
                     pid=os.getpid())
    if cmd == "put":
        client.put(words[1], pattern(int(words[2]), int(words[3])))
        return reply(ok=True)
    if cmd == "get":
        import torch
        got = client.get(words[1])
        return reply(ok=True, equal=bool(torch.equal(got, pattern(int(words[2]), int(words[3])))),
                     copy_mapping=mapping_of(got.data_ptr()))
    if cmd == "view":
        import torch
        want = pattern(int(words[2]), int(words[3]))
        with client.view(words[1]) as v:
            return reply(ok=True, equal=bool(torch.equal(v, want)), mapping=mapping_of(v.data_ptr()))
    if cmd == "timed-put":  # benchmarks: the put alone, its payload made beforehand
        data = pattern(int(words[2]), int(words[3]))
        start = time.perf_counter()
        client.put(words[1], data)
        return reply(ok=True, seconds=time.perf_counter() - start)
    if cmd == "timed-view":  # the zero-copy view taken and let go (lease round trips)
        start = time.perf_counter()
        with client.view(words[1]) as v:
            first = int(v[0])
        return reply(ok=True, seconds=time.perf_counter() - start, first=first)
    if cmd == "hold":
        holds.enter_context(client.view(words[1]))
        return reply(ok=True)
    if cmd == "pin":
        return reply(ok=True, result=client.exists([words[1]], pin_s=float(words[2])))
    if cmd == "delete":
        return reply(ok=True, result=client.delete(words[1]))
    if cmd == "stats":
        return reply(ok=True, result=client.stats())
    if cmd == "churn":
        threading.Thread(target=churn_loop, args=(words[1], words[2], int(words[3])), daemon=True).start()
        return reply(ok=True)
    if cmd == "mark":
        with churn_lock:
            churn["ok_since_mark"] = 0
            churn["errors_since_mark"] = {}
        return reply(ok=True)
    if cmd == "report":
        with churn_lock:
            return reply(ok=True, result=json.loads(json.dumps(churn)))
    return reply(ok=False, error="usage", message=f"unknown command {cmd!r}")


reply(ok=True, ready=True)
for line in sys.stdin:
    words = line.split()
    if not words:
        continue
    if words[0] == "quit":
        break
    try:
        handle(words)
    except Exception as e:  # the test reads the reason; the actor goes on
        reply(ok=False, error=type(e).__name__, message=str(e))
