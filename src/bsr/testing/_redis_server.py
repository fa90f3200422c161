"""Real Redis servers on loopback for tests and ``bsr bench --remote redis``.

How it works: :func:`start_server` runs Debian's ``redis-server`` on 127.0.0.1 on a port it
picks, with no persistence, in a directory of its own, and waits until that process itself
listens on the port (:func:`~bsr.testing.wait_listening`: a port another process holds is
never taken for "started"; the server is started again on another port). The handle kills
(SIGKILL), freezes (SIGSTOP, waiting until every thread is stopped), resumes and restarts the
server (empty, on the same port), always by the PID it started. :func:`start_cluster` starts
three such servers in cluster mode and joins them with ``redis-cli --cluster create`` (no
replicas; ``cluster-require-full-coverage no``, so the other nodes keep serving their slots
when one dies). Everything started is stopped by PID on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ._ports import (
    PortTaken,
    ProcessExited,
    all_threads_stopped,
    dies_with_this_process,
    stop_process,
    unheld_ports,
    wait_listening,
)

#: the Debian package holding redis-server and redis-cli (installed by ``make system-deps``)
REDIS_PACKAGE = "redis-server"
START_ATTEMPTS = 5
#: times a cluster is started afresh when ``redis-cli --cluster create`` fails
CLUSTER_ATTEMPTS = 3


class RedisUnavailable(RuntimeError):
    """redis-server (or redis-cli) is not installed."""


def redis_problem() -> str | None:
    """Why Redis tests cannot run here (None: they can)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py (the bsr-kv[redis] extra)")
    if missing:
        return (
            f"missing {', '.join(missing)}: run make system-deps (apt-get install {REDIS_PACKAGE})"
        )
    return None


@dataclass
class RedisServer:
    """One redis-server process this harness started (loopback only)."""

    port: int
    directory: Path
    cluster: bool = False
    maxmemory: str = "0"
    policy: str = "noeviction"
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def argv(self) -> list[str]:
        args = [
            "redis-server",
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", self.policy,
            "--proto-max-bulk-len", "1gb",
        ]  # fmt: skip
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.directory / "nodes.conf"),
                "--cluster-node-timeout", "2000",
                "--cluster-require-full-coverage", "no",
            ]  # fmt: skip
        return args

    def start(self, timeout_s: float = 30.0) -> None:
        """Start (again) on ``port``; return once this PID listens on it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / "nodes.conf").unlink()  # a restart comes back empty
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        with log:
            self.popen = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=dies_with_this_process(),
            )
        wait_listening(
            self.popen, self.port, time.monotonic() + timeout_s, f"redis-server:{self.port}"
        )

    def kill(self) -> None:
        """SIGKILL (a crash: everything it held is gone)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            assert self.popen is not None
            self.popen.wait(timeout=10)

    def pause(self, timeout_s: float = 30.0) -> None:
        """SIGSTOP, returning once every thread is stopped: it keeps its socket, answers nothing."""
        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all_threads_stopped(self.pid):
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server (pid {self.pid}) did not stop in {timeout_s} s")
            time.sleep(0.001)

    def resume(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGCONT)

    def restart_empty(self) -> None:
        """Kill and start again on the same port, holding nothing."""
        self.kill()
        self.start()

    def stop(self, grace_s: float = 5.0) -> None:
        if self.popen is not None:
            stop_process(self.popen, grace_s)

    def cli(self, *args: str, timeout_s: float = 30.0) -> str:
        """Run ``redis-cli -p <port> args...`` against this server; its stdout."""
        out = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            timeout=timeout_s,
            check=True,
        )
        return out.stdout.decode(errors="replace")


def _start_one(root: Path, name: str, **kw: object) -> RedisServer:
    for _ in range(START_ATTEMPTS):
        (port,) = unheld_ports(1)
        server = RedisServer(port, root / f"{name}-{port}", **kw)  # type: ignore[arg-type]
        try:
            server.start()
            return server
        except (PortTaken, ProcessExited):
            server.stop()
    raise RuntimeError(f"redis-server could not start in {START_ATTEMPTS} attempts")


@contextlib.contextmanager
def start_server(
    *, maxmemory: str = "0", policy: str = "noeviction", directory: Path | None = None
) -> Iterator[RedisServer]:
    """A redis-server on a loopback port of its own, stopped (by PID) on exit."""
    if (problem := redis_problem()) is not None:
        raise RedisUnavailable(problem)
    with contextlib.ExitStack() as stack:
        root = directory or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bsr-redis-"))
        )
        server = _start_one(root, "redis", maxmemory=maxmemory, policy=policy)
        stack.callback(server.stop)
        yield server


@dataclass
class RedisClusterHarness:
    """A Redis Cluster of loopback nodes this harness started (masters only)."""

    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def node_for(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        slot = int(self.nodes[0].cli("cluster", "keyslot", key).strip())
        for line in self.nodes[0].cli("cluster", "nodes").splitlines():
            parts = line.split()
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for span in parts[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return next(n for n in self.nodes if n.port == port)
        raise RuntimeError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@contextlib.contextmanager
def start_cluster(n: int = 3, *, timeout_s: float = 60.0) -> Iterator[RedisClusterHarness]:
    """``n`` cluster-mode redis-servers joined into one cluster (slots split evenly)."""
    if (problem := redis_problem()) is not None:
        raise RedisUnavailable(problem)
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bsr-redis-cluster-")))
        harness = RedisClusterHarness()
        stack.callback(harness.stop)
        for attempt in range(CLUSTER_ATTEMPTS):
            harness.nodes = [
                _start_one(root / f"try{attempt}", f"node{i}", cluster=True) for i in range(n)
            ]
            addresses = [node.address for node in harness.nodes]
            try:
                harness.nodes[0].cli(
                    "--cluster", "create", *addresses, "--cluster-replicas", "0",
                    "--cluster-yes", timeout_s=timeout_s,
                )  # fmt: skip
                break
            except subprocess.CalledProcessError as exc:
                # seen on a machine at load average 17: the join failed; start fresh nodes
                harness.stop()
                if attempt == CLUSTER_ATTEMPTS - 1:
                    said = (exc.stdout or b"").decode(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"redis-cli --cluster create failed {CLUSTER_ATTEMPTS} times; "
                        f"last: exit {exc.returncode}: {said}"
                    ) from exc
        deadline = time.monotonic() + timeout_s
        while not all("cluster_state:ok" in node.cli("cluster", "info") for node in harness.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        yield harness
