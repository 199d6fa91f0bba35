"""The daemon a benchmark starts for itself: a private node, runtime dir and config, metrics on a
free port, killed with the benchmark even if that dies by SIGKILL, stopped with SIGTERM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from ecd.client.client import Client
from ecd.errors import EcdError


def proc_memory_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, RssAnon (private: where a leak would live) and RssShmem (pool pages touched) of a
    process, in KiB, from /proc/PID/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssShmem"):
                out[name] = int(value.split()[0])
    return out


def write_results(path: str, res: dict) -> None:
    """`--json PATH` of every benchmark: the results document, indented ('-': stdout)."""
    text = json.dumps(res, indent=2, default=float)
    if path == "-":
        print(text)
        return
    with open(path, "w") as f:
        f.write(text)
    print(f"results written to {path}")


def pool_prefaulted(client: Client) -> Client:
    """`client` once its pool mappings are prefaulted (ecd.memory.prefault runs that in a thread
    after connecting): measurements start from the steady state, not beside that thread."""
    thread = getattr(client.mapping, "prefaulting", None)  # None: a tree that maps with MAP_POPULATE
    if thread is not None:
        thread.join(120)
    return client


def _die_with_parent() -> None:
    """In the daemon's child before exec: SIGTERM it if the benchmark dies (even by SIGKILL)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class BenchDaemon:
    def __init__(self, workdir: str, node_prefix: str = "bench", pool: str = "1GiB",
                 metrics: str = "127.0.0.1:0", extra: str = "", control: str = "") -> None:
        """`metrics`: [metrics] listen; `extra`: more TOML appended to the config; `control`: more
        keys of [control]."""
        self.node = f"{node_prefix}{os.getpid()}"
        self.runtime_dir = os.path.join(workdir, "run")
        self.endpoint = f"ipc://{self.runtime_dir}/ecd.sock"
        self.config_path = os.path.join(workdir, "node.toml")
        self.log_path = os.path.join(workdir, "daemon.log")
        with open(self.config_path, "w") as f:
            f.write(f'[node]\nname = "{self.node}"\nruntime_dir = "{self.runtime_dir}"\n'
                    f'log_level = "warning"\n\n[control]\nendpoint = "{self.endpoint}"\n{control}\n'
                    f'[pool.host]\nsize = "{pool}"\n\n[metrics]\nlisten = "{metrics}"\n{extra}')
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "ecd", "serve", "--config", self.config_path],
                                     stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def connect(self, namespace: str = "default", timeout: float = 5.0, name: str = "bench-main",
                wait_s: float = 60.0) -> Client:
        deadline = time.monotonic() + wait_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                return pool_prefaulted(Client(self.endpoint, namespace, timeout=timeout, name=name))
            except EcdError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"daemon did not answer within {wait_s}s:\n{self.log_tail()}") from None
                time.sleep(0.1)

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        # A final stop: the holder the daemon spawned ([restart]) lets the pool go now, instead of
        # keeping it `hold` seconds for a next run that a benchmark never starts.
        from ecd.daemon.restart.holder_client import HolderKeeper
        HolderKeeper(self.node, self.runtime_dir, spawn=False).release()
        return self.proc.returncode

    def log_tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return "".join(f.readlines()[-20:])
