"""The tenant tests' clients and daemons (tests/security/test_tenants.py, test_tenant_sizes.py):
client processes of other uids (tenant_client.py), and a daemon whose runtime directory only
root and the daemon's group reach, so the tenants' uids get in by the sockets' ACL entries alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from secutil import write_node_toml

TENANT_CLIENT = Path(__file__).resolve().parent / "tenant_client.py"
A_UID, B_UID, STRANGER = 4242, 4343, 4444
A_GID, B_GID = 7001, 7002

TENANTS = f"""
[tenants.team-a]
uids = [{A_UID}]
gids = [{A_GID}]
[tenants.team-b]
uids = [{B_UID}]
gids = [{B_GID}]
"""
SIZE_MIB = 12  # each sized tenant's part of the tests' 64 MiB pool
# the same tenants, each with a size (its part of the pool: tests/security/test_tenant_sizes.py)
SIZED = TENANTS.replace("[tenants.team-b]", f'size = "{SIZE_MIB}MiB"\n[tenants.team-b]') + f'size = "{SIZE_MIB}MiB"\n'


def run_as(endpoint: str, uid: int, what: str, ns: str, *args, gid: int | None = None, groups=()) -> dict:
    """tenant_client.py as `uid`: what it printed."""
    out = subprocess.run([sys.executable, str(TENANT_CLIENT), endpoint, str(uid), str(uid if gid is None else gid),
                          ",".join(map(str, groups)) or "-", what, ns, *map(str, args)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def start(d, tables: str = TENANTS, control: str = "") -> None:
    write_node_toml(d, control=control, tables=tables)
    os.chmod(d.runtime_dir, 0o750)  # others reach nothing: the tenants' uids by ACL entries alone
    d.start()
