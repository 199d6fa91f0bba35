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
