"""For helper processes that play another local user: drop to `uid` (its primary group, no
supplementary groups) once everything they need is imported (/root, where this Python's files may
sit, is 0700 to that user)."""
from __future__ import annotations

import os
import pwd


def drop_to(uid: int) -> None:
    gid = pwd.getpwuid(uid).pw_gid
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def drop_if_asked(argv: list[str]) -> list[str]:
    """A helper process's arguments: a leading `--uid UID` drops to that user (drop_to) and is
    taken off; the rest is returned."""
    if argv and argv[0] == "--uid":
        drop_to(int(argv[1]))
        return argv[2:]
    return argv
