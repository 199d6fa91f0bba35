"""Who holds a test daemon's pool memory: holder processes, memfds and /dev/shm files open or
mapped in any process of ours (read from /proc), for the restart tests' "nothing leaks" checks."""
from __future__ import annotations

import os
from pathlib import Path


def holder_pids(node: str) -> list[int]:
    """Holder processes (`ecd hold` / python -m ecd.daemon.restart.holder) of `node`."""
    pids = []
    for pid in _pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"holder" in a or a == b"hold" for a in argv) and node.encode() in argv:
            pids.append(pid)
    return pids


def memfds(node: str) -> dict[tuple[int, int], list[str]]:
    """{(dev, inode): ["pid fd", ...]} of the memfds of `node` open in any process (ours)."""
    found: dict[tuple[int, int], list[str]] = {}
    prefix = f"/memfd:ecd.{node}."
    for pid, fd, path in _open_fds():
        try:
            if os.readlink(path).startswith(prefix):
                st = os.stat(path)
                found.setdefault((st.st_dev, st.st_ino), []).append(f"{pid} {fd}")
        except OSError:
            continue
    return found


def mapped(node: str) -> list[str]:
    """Mappings of `node`'s pool memory (memfds or /dev/shm files) in any process."""
    lines = []
    for pid in _pids():
        try:
            text = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        lines += [f"{pid}: {line}" for line in text.splitlines()
                  if f"/memfd:ecd.{node}." in line or f"/dev/shm/ecd.{node}." in line]
    return lines


def held_by(pid: int, node: str) -> dict[tuple[int, int], int]:
    """{(dev, inode): size} of the node's pool memory (memfds or /dev/shm files) `pid` holds."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith((f"/memfd:ecd.{node}.", f"/dev/shm/ecd.{node}.")):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                held[(st.st_dev, st.st_ino)] = st.st_size
        except OSError:
            continue
    return held


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def open_anywhere(inodes) -> bool:
    """Some process has a descriptor of one of these (dev, inode)s open."""
    for _, _, path in _open_fds():
        try:
            st = os.stat(path)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in inodes:
            return True
    return False


def _open_fds():
    """(pid, fd, /proc path) of every descriptor open in any process we may look into."""
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            yield pid, fd, f"/proc/{pid}/fd/{fd}"
