"""The README's container commands, run as written (issue 41, item 5: its `podman run` example
failed as printed). The block is read from README.md itself, so a change there is tested here; the
only substitutions are what a test must own: a temporary socket directory and working directory,
a unique container name, `sudo` (the tests run as root) and the placeholder engine image, which
becomes the ecd image running `ecd status` against the socket, as the engine's uid would connect.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import uuid

import pytest

from containers_util import IMAGE, REPO, podman, unavailable_reason


def readme_block(containing: str) -> list[str]:
    """The commands of the README's ```sh block that contains `containing`, continuation lines
    joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        if containing in block:
            joined = block.replace("\\\n", " ")
            return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]
    raise AssertionError(f"README.md has no ```sh block with {containing!r}")


def test_the_readmes_daemon_and_engine_containers_run_as_written():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    commands = readme_block("podman run -d --name ecd")
    work = tempfile.mkdtemp(prefix="ecd-readme-", dir="/tmp")  # the working directory: a checkout's view
    os.symlink(REPO / "deploy", os.path.join(work, "deploy"))
    sockets = os.path.join(work, "run")
    name = f"ecd-readme-{uuid.uuid4().hex[:8]}"
    script = []
    for command in commands:
        command = re.sub(r"^sudo (--preserve-env=\S+ )?", "", command)
        command = (command.replace("/run/ecd-node", sockets).replace("--name ecd ", f"--name {name} ")
                   .replace("podman exec ecd ", f"podman exec {name} ")
                   .replace("my-engine", f"{IMAGE} status --endpoint ipc:///run/ecd/ecd.sock --interval 0"))
        script.append(command)
        if "podman run -d" in command:  # the daemon serving before the next command talks to it
            script.append(f"for i in $(seq 300); do podman logs {name} 2>&1 | grep -q 'serving node' && break; "
                          "sleep 0.2; done")
    env = {k: v for k, v in os.environ.items() if k != "CONTAINERS_CONF"}  # the README's export must do it
    try:
        out = subprocess.run(["bash", "-euxc", "\n".join(script)], cwd=work, capture_output=True, text=True,
                             timeout=300, env=env)
        assert out.returncode == 0, f"exited {out.returncode}: {out.stderr[-3000:]}"
        # `podman exec ... ecd status` (the image's $ECD_CONFIG) and the engine's uid through the group
        assert out.stdout.count("entries") >= 2, (out.stdout[-2000:], out.stderr[-2000:])
        assert oct(os.stat(os.path.join(work, "node.toml")).st_mode & 0o777) and os.path.isdir(sockets)
    finally:
        podman("rm", "-f", "-t", "0", name, check=False, timeout=60)
        shutil.rmtree(work, ignore_errors=True)
