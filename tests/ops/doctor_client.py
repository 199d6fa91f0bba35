"""A client that test_doctor.py runs where the daemon's resources are out of its reach.

    doctor_client.py [--uid UID] control ENDPOINT   ecd.ControlClient: ping
    doctor_client.py [--uid UID] tensors ENDPOINT   ecd.Client: connect, then a 256-byte put

--uid: started as root, it drops to that uid (its own group, no supplementary groups) once its
modules are imported (this Python's files may sit where that user cannot read). Prints one JSON
line: the uid it ran as, how it ended ("ok", or the error's class and message) and the seconds
the attempt took.
"""
from __future__ import annotations

import encodings.idna  # noqa: F401 - looked up lazily; after the drop it may not be readable
import json
import os
import sys
import time
from pathlib import Path

import zmq.utils.monitor  # noqa: F401 - the client imports it lazily on a timeout

from ecd.client.control import ControlClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: privileges.py
from privileges import drop_if_asked  # noqa: E402


def main(argv: list[str]) -> None:
    if "tensors" in argv:  # before any drop: torch takes seconds, and its files may be unreadable after
        import torch

        from ecd import Client
    what, endpoint = drop_if_asked(argv)
    out: dict = {"uid": os.getuid()}
    started = time.monotonic()
    try:
        if what == "control":
            with ControlClient(endpoint, timeout=5.0) as client:
                client.ping()
        else:
            with Client(endpoint, timeout=5.0) as client:
                client.put("small", torch.arange(32, dtype=torch.int64))
        out["result"] = "ok"
    except Exception as exc:  # what the test looks at
        out["result"] = type(exc).__name__
        out["message"] = str(exc)
    out["seconds"] = time.monotonic() - started
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
