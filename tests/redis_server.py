"""A real redis-server for tests and benchmarks: on 127.0.0.1 only, a free port, nothing saved,
optionally with a password (`requirepass` in its config file, which only the test reads; the
daemons get it through `[cluster] directory_password_file`). Restartable on the same port:
.kill() then .start() gives an empty store, as a restarted cache without persistence is."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import redis

from ports import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


class RedisServer:
    def __init__(self, password: str | None = None, port: int = 0) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="ecd-redis-", dir="/tmp")
        self.password = password
        self.password_file = ""
        if password is not None:
            self.password_file = self.write_password_file("password", password)
        self.proc: subprocess.Popen | None = None

    def write_password_file(self, name: str, text: str) -> str:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        return path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        conf = os.path.join(self.dir, "redis.conf")
        with open(conf, "w") as f:
            f.write(f'bind 127.0.0.1\nport {self.port}\nsave ""\nappendonly no\nprotected-mode yes\n'
                    f"dir {self.dir}\n" + (f"requirepass {self.password}\n" if self.password else ""))
        os.chmod(conf, 0o600)
        self.proc = subprocess.Popen([REDIS_SERVER, conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}") from None
                time.sleep(0.02)
        raise RuntimeError("redis-server did not answer in time")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, decode_responses=True,
                           socket_timeout=2.0)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def redis_server():
    """A running redis-server on 127.0.0.1 without a password; .kill() then .start() restarts it
    empty. Import it into a test module (`from redis_server import redis_server`)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_with_password():
    server = RedisServer(password="s3cret-for-tests")
    server.start()
    yield server
    server.stop()
