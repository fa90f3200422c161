"""A throwaway Mooncake cluster on 127.0.0.1 for tests and ``bsr bench --remote mooncake``.

Processes, each started by PID and stopped by PID (SIGTERM, then SIGKILL), each one ready only
once *that PID* listens on the port chosen for it (read from ``/proc``, see
:mod:`bsr.testing._ports`): a port another process holds is never mistaken for the cluster's
(the process is stopped and started again on fresh ports):

- ``mooncake_master``: metadata and placement (``--rpc_address=127.0.0.1``, free port; no HTTP
  metadata server: the transfer engines use ``P2PHANDSHAKE``).
- a *memory holder*: ``mooncake_client`` with a global segment, so objects live in ANOTHER
  process and cross TCP to reach a reader.
- a *gateway*: ``mooncake_client`` without a segment; tiers in standalone-client mode attach to
  it (``MooncakeTier(client_address=...)``) over its RPC port and shared memory, so the test
  process itself listens on no port.

Mooncake's transfer engine binds its handshake and TCP data listeners to INADDR_ANY / in6addr_any
unconditionally (mooncake-transfer-engine ``transfer_metadata_plugin.cpp``; no flag or variable
changes it). Every process started here therefore runs with a tiny LD_PRELOAD shim (compiled
once with the system C compiler) that rewrites wildcard ``bind()`` addresses to loopback;
:meth:`MooncakeCluster.subprocess_env` gives the same environment to helper subprocesses that
run an embedded-mode client.

Use :func:`start_cluster` (a context manager); :func:`mooncake_problem` says why a cluster
cannot start here. For tests, :func:`require_mooncake` skips when Mooncake is missing, and fails
instead when the environment variable ``CI`` is ``true``; the pytest fixtures
``mooncake_cluster`` and ``fresh_mooncake_cluster`` live in ``tests/mooncake_server.py`` (this
module does not import pytest unless :func:`require_mooncake` is called).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
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

#: the Mooncake wheel the tests are written against
MOONCAKE_REQUIREMENT = "mooncake-transfer-engine-non-cuda==0.3.13.post1"

_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

/* bsr test shim: rewrite wildcard binds to loopback (IPv6 wildcard -> ::ffff:127.0.0.1 so a
   dual-stack listener still accepts IPv4 loopback connections). */
typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind = 0;
    if (!real_bind) real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    if (addr && addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        struct sockaddr_in a;
        memcpy(&a, addr, sizeof a);
        if (a.sin_addr.s_addr == htonl(INADDR_ANY)) {
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    } else if (addr && addr->sa_family == AF_INET6 &&
               len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 a;
        memcpy(&a, addr, sizeof a);
        if (memcmp(&a.sin6_addr, &in6addr_any, sizeof(struct in6_addr)) == 0) {
            static const unsigned char mapped[16] = {0, 0, 0, 0, 0, 0, 0, 0,
                                                     0, 0, 0xff, 0xff, 127, 0, 0, 1};
            memcpy(&a.sin6_addr, mapped, sizeof mapped);
            return real_bind(fd, (const struct sockaddr *)&a, sizeof a);
        }
    }
    return real_bind(fd, addr, len);
}
"""


class MooncakeUnavailable(RuntimeError):
    """Mooncake (package, binaries, system library or C compiler for the shim) is missing."""


@dataclass(frozen=True)
class MooncakeBinaries:
    """Paths of the Mooncake server binaries and of the installed package."""

    master: Path
    client: Path
    package_dir: Path


def find_mooncake() -> MooncakeBinaries:
    """Locate the Mooncake package and its ``mooncake_master`` / ``mooncake_client`` binaries."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeUnavailable(
            f"the mooncake package is not installed (pip install {MOONCAKE_REQUIREMENT!r})"
        )
    pkg = Path(next(iter(spec.submodule_search_locations)))
    try:
        import mooncake.store  # noqa: F401  (fails without libibverbs1)
    except ImportError as exc:
        raise MooncakeUnavailable(
            f"mooncake.store does not import ({exc}); reinstall {MOONCAKE_REQUIREMENT!r} and "
            "check that the system library libibverbs1 is installed (apt-get install libibverbs1)"
        ) from exc
    found: dict[str, Path] = {}
    for name in ("mooncake_master", "mooncake_client"):
        # the ELF binaries inside the wheel (exec'ed directly, so the PID is the server's)
        cand = pkg / name
        if not cand.is_file():
            which = shutil.which(name)
            if which is None:
                raise MooncakeUnavailable(f"{name} binary not found in {pkg} nor on PATH")
            cand = Path(which)
        if not os.access(cand, os.X_OK):
            cand.chmod(cand.stat().st_mode | 0o111)
        found[name] = cand
    return MooncakeBinaries(found["mooncake_master"], found["mooncake_client"], pkg)


def loopback_shim() -> Path:
    """Compile (once, cached in the temp dir) the wildcard-bind-to-loopback LD_PRELOAD shim."""
    digest = hashlib.sha256(_SHIM_SOURCE.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"bsr-loopback-bind-{digest}.so"
    if out.is_file():
        return out
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise MooncakeUnavailable(
            "no C compiler to build the loopback-bind shim (Mooncake binds 0.0.0.0 otherwise); "
            "apt-get install gcc"
        )
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "shim.c"
        src.write_text(_SHIM_SOURCE)
        obj = Path(tmp) / "shim.so"
        res = subprocess.run(
            [cc, "-shared", "-fPIC", "-O2", "-o", str(obj), str(src), "-ldl"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if res.returncode != 0:
            raise MooncakeUnavailable(
                f"building the loopback-bind shim failed: {res.stderr[-2000:]}"
            )
        partial = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(obj, partial)
        os.replace(partial, out)
    return out


def mooncake_problem() -> str | None:
    """Why a Mooncake cluster cannot be started here, or None when it can."""
    try:
        find_mooncake()
        loopback_shim()
    except MooncakeUnavailable as exc:
        return str(exc)
    return None


def require_mooncake() -> MooncakeBinaries:
    """Skip the calling test when Mooncake is missing; fail instead when ``CI=true``."""
    problem = mooncake_problem()
    if problem is not None:
        import pytest

        msg = f"Mooncake is not available: {problem}"
        if os.environ.get("CI", "").strip().lower() == "true":
            pytest.fail(msg + " (CI=true: Mooncake tests must run)", pytrace=False)
        pytest.skip(msg)
    return find_mooncake()


#: how often the cluster is started again on fresh ports (a port taken, or a process that died
#: while starting)
START_ATTEMPTS = 5


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def stop(self, grace_s: float = 5.0) -> None:
        stop_process(self.popen, grace_s)

    def tail(self, nbytes: int = 3000) -> str:
        try:
            return self.log.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""


@dataclass
class MooncakeCluster:
    """Addresses of a running test cluster, and handles to break it."""

    master_address: str
    client_address: str
    metadata_server: str
    log_dir: Path
    shim: Path
    procs: dict[str, _Proc] = field(default_factory=dict)

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def alive(self, name: str) -> bool:
        return self.procs[name].alive()

    def kill_master(self) -> None:
        """SIGKILL the master (a crash: no clean shutdown)."""
        self._kill("master")

    def pause_master(self, timeout_s: float = 30.0) -> None:
        """SIGSTOP the master and return once every thread of it is stopped: it keeps its
        sockets but answers nothing (a hang).

        SIGSTOP is not synchronous: the group stop begins when one of the master's threads
        next runs, and until then its other threads keep answering (on a loaded machine, for
        milliseconds: long enough for a request sent right after ``kill`` to be served).
        """
        proc = self.procs["master"]
        proc.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not all_threads_stopped(proc.pid):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"master (pid {proc.pid}) did not stop within {timeout_s} s")
            time.sleep(0.001)

    def resume_master(self) -> None:
        self.procs["master"].signal(signal.SIGCONT)

    def kill_memory(self) -> None:
        """SIGKILL the process holding the store memory (its objects are gone)."""
        self._kill("memory")

    def kill_gateway(self) -> None:
        """SIGKILL the mooncake_client that standalone-mode tiers attach to."""
        self._kill("gateway")

    def _kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)

    def stop(self) -> None:
        for name in ("gateway", "memory", "master"):
            if name in self.procs:
                self.procs[name].stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.pid}) ---\n{p.tail()}" for p in self.procs.values())

    def subprocess_env(self) -> dict[str, str]:
        """Environment for a subprocess running an embedded-mode client: loopback-only binds."""
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(x for x in (str(self.shim), env.get("LD_PRELOAD", "")) if x)
        return env


def _spawn(name: str, argv: list[str], port: int, log_dir: Path, shim: Path) -> _Proc:
    log = log_dir / f"{name}.log"
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(x for x in (str(shim), env.get("LD_PRELOAD", "")) if x)
    with open(log, "ab") as fh:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=dies_with_this_process(),
        )
    return _Proc(name, popen, port, log)


def _start(
    cluster: MooncakeCluster,
    name: str,
    argv: Callable[[list[int]], list[str]],
    nports: int,
    deadline: float,
) -> list[int]:
    """Start ``name`` on ``nports`` fresh ports (``argv(ports)``); return once its own PID
    listens on the first one. Raises what :func:`wait_listening` raises."""
    ports = unheld_ports(nports)
    proc = _spawn(name, argv(ports), ports[0], cluster.log_dir, cluster.shim)
    cluster.procs[name] = proc
    wait_listening(proc.popen, ports[0], deadline, name)
    return ports


def _launch(
    cluster: MooncakeCluster,
    bins: MooncakeBinaries,
    *,
    segment_bytes: int,
    gateway_buffer_bytes: int,
    client_ttl_s: int,
    master_flags: Sequence[str],
    deadline: float,
) -> None:
    """Start master, memory holder and gateway, in that order, each owning its port."""
    mport, _ = _start(
        cluster,
        "master",
        lambda ports: [
            str(bins.master),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={ports[0]}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={ports[1]}",
            "--enable_http_metadata_server=false",
            f"--client_ttl={client_ttl_s}",
            "--logtostderr",
            *master_flags,
        ],
        2,
        deadline,
    )
    cluster.master_address = f"127.0.0.1:{mport}"
    common = [
        f"--master_server_address={cluster.master_address}",
        "--metadata_server=P2PHANDSHAKE",
        "--protocol=tcp",
        "--host=127.0.0.1",
        "--logtostderr",
    ]
    _start(
        cluster,
        "memory",
        lambda ports: [
            str(bins.client),
            f"--port={ports[0]}",
            f"--global_segment_size={segment_bytes}",
            "--local_buffer_size=0",
            *common,
        ],
        1,
        deadline,
    )
    (gport,) = _start(
        cluster,
        "gateway",
        lambda ports: [
            str(bins.client),
            f"--port={ports[0]}",
            "--global_segment_size=0",
            f"--local_buffer_size={gateway_buffer_bytes}",
            *common,
        ],
        1,
        deadline,
    )
    cluster.client_address = f"127.0.0.1:{gport}"


@contextlib.contextmanager
def start_cluster(
    *,
    segment_bytes: int = 256 * 1024 * 1024,
    gateway_buffer_bytes: int = 64 * 1024 * 1024,
    client_ttl_s: int = 10,
    ready_timeout_s: float = 30.0,
    log_dir: Path | None = None,
    master_flags: Sequence[str] = (),
) -> Iterator[MooncakeCluster]:
    """Start master, memory holder and gateway on 127.0.0.1; stop them on exit.

    ``segment_bytes`` is the memory holder's store segment (Mooncake needs at least 16 MiB);
    ``master_flags`` are extra ``mooncake_master`` flags, e.g. eviction settings.

    Each process gets ports no one listens on, and counts as up once its own PID listens on
    its port. If another process takes a port first, or a process dies while starting, every
    process started so far is stopped by PID and the whole cluster starts again on fresh ports
    (at most :data:`START_ATTEMPTS` times): a restarted memory holder alone would leave its
    dead predecessor's segment registered at the master until ``client_ttl_s`` passes.
    """
    bins = find_mooncake()
    shim = loopback_shim()
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bsr-mooncake-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        cluster = MooncakeCluster(
            master_address="",
            client_address="",
            metadata_server="P2PHANDSHAKE",
            log_dir=log_dir,
            shim=shim,
        )
        stack.callback(cluster.stop)
        deadline = time.monotonic() + ready_timeout_s
        problems: list[str] = []
        for _ in range(START_ATTEMPTS):
            try:
                _launch(
                    cluster, bins, segment_bytes=segment_bytes,
                    gateway_buffer_bytes=gateway_buffer_bytes, client_ttl_s=client_ttl_s,
                    master_flags=master_flags, deadline=deadline,
                )  # fmt: skip
                break
            except (PortTaken, ProcessExited) as exc:
                problems.append(str(exc))
                cluster.stop()
                cluster.procs.clear()
            except TimeoutError as exc:
                raise RuntimeError(f"{exc}\n{cluster.logs()}") from None
        else:
            raise RuntimeError(
                f"the cluster did not start in {START_ATTEMPTS} attempts: {problems}\n"
                f"{cluster.logs()}"
            )
        yield cluster
