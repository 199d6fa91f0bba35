"""Real containers for tests/containers and benchmarks/bench_containers.py: the ecd daemon in one
(rootful podman, the image `make image` builds), clients in others, each with its own pid, IPC,
mount and network namespaces (--network=none), its own uid, no capabilities, nothing privileged;
only the socket directory (a host directory) is mounted into all of them.

Everything here skips with the reason when it cannot run (not root, no podman, no image, an
image built from other sources): `make test` never builds images. `make test-containers` builds
the image first and sets ECD_CONTAINER_TESTS=1, which turns those reasons into failures.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
IMAGE = os.environ.get("ECD_IMAGE", "localhost/ecd:latest")
CONF = os.environ.get("CONTAINERS_CONF", str(REPO / "deploy" / "podman" / "containers.conf"))
ACTOR_CODE = (Path(__file__).parent / "container_actor.py").read_text()
DAEMON_UID = 10001  # the image's `ecd` user (deploy/image/build.sh ECD_UID)
CLIENT_UID = 20001  # admitted by [control] allowed_uids
STRANGER_UID = 20002  # not admitted
ENDPOINT = "ipc:///run/ecd/ecd.sock"
# No capabilities, no privilege gain, no network, none of the host's namespaces.
CONFINED = ["--network=none", "--cap-drop=all", "--security-opt=no-new-privileges"]
_names = itertools.count()


def podman(*args: str, timeout: float = 120, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, CONTAINERS_CONF=CONF)
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why real containers cannot run here, or None."""
    if os.geteuid() != 0:
        return "the container tests use rootful podman: run them as root (sudo make test-containers)"
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc uidmap; then make image)"
    proc = podman("image", "inspect", "--format", '{{ index .Labels "io.ecd.source-digest" }}', IMAGE,
                  check=False, timeout=60)
    if proc.returncode != 0:
        return f"image {IMAGE} not built ({proc.stderr.strip()[:120]}): make image, or make test-containers"
    digest = subprocess.run([str(REPO / "deploy" / "image" / "build.sh"), "--digest"], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    if digest.returncode == 0 and digest.stdout.strip() != proc.stdout.strip():
        return (f"image {IMAGE} was built from other sources than this tree (it would test other code): "
                f"make image, or make test-containers")
    return None


def probe_features() -> dict[str, str | None]:
    """Which of issue 24's daemon features the image's ecd has: None, or why not. Each needs its
    config key accepted (`ecd check-config`) and the module that implements it (the keys came
    into the config before the code behind them)."""
    probes = {"memfd": ('[pool.host]\nsize = "64MiB"\nbacking = "memfd"\n', "ecd.daemon.control.fd_server"),
              "admission": ('[control]\nallowed_uids = [20001]\nallowed_gids = []\n[pool.host]\nsize = "64MiB"\n',
                            "ecd.daemon.control.admission")}
    with tempfile.TemporaryDirectory(prefix="ecd-probe-") as tmp:
        script = []
        for name, (text, module) in probes.items():
            Path(tmp, f"{name}.toml").write_text(text)
            script.append(f'out=$(ecd check-config /probe/{name}.toml 2>&1 && python -c "import {module}" 2>&1); '
                          f'echo "{name} $? $(printf %s "$out" | tail -n 1)"')
        os.chmod(tmp, 0o755)
        out = podman("run", "--rm", *CONFINED, "--no-healthcheck", "-v", f"{tmp}:/probe:ro",
                     "--entrypoint", "/bin/sh", IMAGE, "-c", "; ".join(script)).stdout
    answers = {words[0]: words[1:] for words in (line.split(maxsplit=2) for line in out.splitlines()) if words}
    return {name: None if answers.get(name, ["?"])[0] == "0" else
            f"the image's ecd does not have it: {' '.join(answers.get(name, ['no answer'])[1:])[:200]}"
            for name in probes}


def namespaces_of(pid: int) -> dict[str, str]:
    return {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in ("pid", "ipc", "mnt", "net", "user")}


class Actor:
    """container_actor.py in a container of its own (or exec'ed in the daemon's): a line protocol
    over the attached stdin/stdout of `podman run -i`."""

    def __init__(self, argv: list[str], label: str, env: dict[str, str] | None = None) -> None:
        self.label = label
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=dict(os.environ, CONTAINERS_CONF=CONF, **(env or {})))
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def read(self, timeout: float = 60.0) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.label}: no answer within {timeout}s; stderr: {self.errors()}") from None
        if line is None:
            raise AssertionError(f"{self.label} ended (rc {self.proc.poll()}); stderr: {self.errors()}")
        return json.loads(line)

    def ask(self, command: str, timeout: float = 60.0) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def ok(self, command: str, timeout: float = 60.0) -> dict:
        answer = self.ask(command, timeout)
        assert answer.get("ok"), f"{self.label}: {command!r} -> {answer}; stderr: {self.errors()}"
        return answer

    def errors(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-2000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            with_suppressed(lambda: self.proc.stdin.write("quit\n"))
            with_suppressed(self.proc.stdin.close)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def with_suppressed(fn) -> None:
    try:
        fn()
    except (OSError, ValueError):
        pass


class ContainerNode:
    """One node: a socket directory on the host, the daemon in its container, clients in theirs."""

    def __init__(self, extra_config: str = "", pool: str = "128MiB") -> None:
        self.prefix = f"ecd-t{os.getpid()}-{next(_names)}"
        self.dir = Path(tempfile.mkdtemp(prefix="ecd-ctr-", dir="/tmp"))
        self.sockets = self.dir / "run"  # the only host path the clients see, at /run/ecd
        self.sockets.mkdir()
        os.chown(self.sockets, DAEMON_UID, DAEMON_UID)
        os.chmod(self.sockets, 0o770)  # the daemon's group: clients get it with --group-add
        self.config = self.dir / "node.toml"
        self.config.write_text(f"""
[node]
name = "{self.prefix}"
runtime_dir = "/run/ecd"
log_level = "debug"
[control]
endpoint = "{ENDPOINT}"
{extra_config}
[pool.host]
size = "{pool}"
[metrics]
listen = "0.0.0.0:9464"
""")
        os.chmod(self.config, 0o644)
        self.daemon = f"{self.prefix}-daemon"
        self.actors: list[Actor] = []

    def start_daemon(self, timeout: float = 60.0) -> None:
        # The health check runs when asked (podman healthcheck run): no systemd timers here.
        podman("run", "-d", "--name", self.daemon, *CONFINED, "--read-only", "--shm-size=256m",
               "--health-interval=disable", "-v", f"{self.sockets}:/run/ecd", "-v",
               f"{self.config}:/etc/ecd/node.toml:ro", IMAGE)
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if podman("healthcheck", "run", self.daemon, check=False, timeout=30).returncode == 0:
                return
            state = podman("inspect", "--format", "{{.State.Status}}", self.daemon, check=False).stdout.strip()
            if state not in ("running", "created", "configured", "initialized"):
                break
            time.sleep(0.3)
        raise AssertionError(f"daemon container not healthy within {timeout}s: {self.logs()}")

    def logs(self) -> str:
        return podman("logs", self.daemon, check=False).stdout[-4000:]

    def started_at(self) -> str:
        return podman("inspect", "--format", "{{.State.StartedAt}}", self.daemon).stdout.strip()

    def daemon_pid(self) -> int:
        return int(podman("inspect", "--format", "{{.State.Pid}}", self.daemon).stdout)

    def client(self, label: str, uid: int = CLIENT_UID, groups: tuple[int, ...] = (DAEMON_UID,),
               connect_timeout: float = 5.0, connect: bool = True) -> Actor:
        """A client in a container of its own: its own pid/IPC/mount/network namespaces, uid `uid`
        (in the daemon's group, so unix permissions let it reach the socket), the socket
        directory mounted and nothing else of the host."""
        name = f"{self.prefix}-{label}"
        argv = ["podman", "run", "-i", "--rm", "--name", name, *CONFINED, "--read-only", "--no-healthcheck",
                "--user", f"{uid}:{uid}", *(f"--group-add={g}" for g in groups), "-e", "HOME=/tmp",
                "-v", f"{self.sockets}:/run/ecd", "--entrypoint", "/opt/ecd/venv/bin/python", IMAGE,
                "-c", ACTOR_CODE, ENDPOINT]
        actor = self._started(Actor(argv, name))
        if connect:
            actor.ok(f"connect {connect_timeout}")
        return actor

    def observer(self) -> Actor:
        """A control client exec'ed in the daemon's own container, as the daemon's uid (always
        admitted): stats from where an operator runs `ecd status`."""
        argv = ["podman", "exec", "-i", self.daemon, "/opt/ecd/venv/bin/python", "-c", ACTOR_CODE,
                ENDPOINT, "control"]
        actor = self._started(Actor(argv, f"{self.daemon}-observer"))
        actor.ok("connect 5")
        return actor

    def _started(self, actor: Actor) -> Actor:
        self.actors.append(actor)
        first = actor.read(timeout=120)  # a client container imports torch: 2-5 s, more under load
        assert first.get("ready"), f"{actor.label}: {first}"
        return actor

    def kill(self, actor: Actor) -> None:
        podman("kill", "--signal", "KILL", actor.label, timeout=30)

    def close(self) -> None:
        for actor in self.actors:
            actor.close()
        for actor in self.actors:
            podman("rm", "-f", "-t", "0", actor.label, check=False, timeout=60)
        podman("rm", "-f", "-t", "5", self.daemon, check=False, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)
