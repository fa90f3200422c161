"""MooncakeTier against a real Mooncake Store cluster started on 127.0.0.1 by the fixtures.

In-process tests use standalone-client mode (``client_address``: the test process attaches to
the fixture's gateway ``mooncake_client`` and listens on no port); embedded mode
(``master_address``) runs in a subprocess under the loopback-bind shim, because Mooncake's
transfer engine binds wildcard addresses (see tests/mooncake_server.py).

Tests marked ``mooncake`` are skipped when Mooncake is missing, except under ``CI=true`` where
that is a failure. The tests at the end drive the tier against a fake in-process store client
(timeouts, abandoned calls, bounce-buffer ownership) and need no Mooncake.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from bsr._errors import (
    BsrError,
    ConfigError,
    CorruptObjectError,
    ForeignObjectError,
    ObjectNotFoundError,
    TierError,
    TierIOError,
    TierTimeoutError,
    TruncatedObjectError,
)
from bsr.core._keys import ChunkKey, ObjectKey
from bsr.core._object import HEADER_SIZE, encode_object
from bsr.testing import TierConformance, make_keys, payload, put_raw_stored
from bsr.tiers._base import Tier
from bsr.tiers._mooncake import MooncakeTier

try:
    from mooncake_server import (
        MooncakeCluster,
        fresh_mooncake_cluster,
        frozen_master_cluster,
        mooncake_cluster,
        require_mooncake,
    )
except ImportError:  # tests/ imported as a package
    from tests.mooncake_server import (  # type: ignore[no-redef]
        MooncakeCluster,
        fresh_mooncake_cluster,
        frozen_master_cluster,
        mooncake_cluster,
        require_mooncake,
    )

# fixtures used by name
__all__ = ["fresh_mooncake_cluster", "frozen_master_cluster", "mooncake_cluster"]

pytestmark = pytest.mark.timeout(300)
#: tests that start a real cluster (the fake-store tests at the end run everywhere)
needs_mooncake = pytest.mark.mooncake

REPO = Path(__file__).resolve().parents[2]
#: slack on top of a tier timeout for "fails within its timeout" checks. Without the timeout
#: these calls wait on a frozen or dead master forever, so a generous slack still tells the two
#: apart, and a busy machine (a CPU burner beside these tests took 1.5 s past a 1 s timeout
#: once) does not fail them.
MARGIN_S = 10.0


def make_tier(cluster: MooncakeCluster, **kw: Any) -> MooncakeTier:
    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("key_prefix", MooncakeTier.unique_prefix())
    return MooncakeTier(client_address=cluster.client_address, **kw)


# ---------------------------------------------------------------------- conformance
@needs_mooncake
class TestMooncakeConformance(TierConformance):
    """The generic suite; every tier gets a fresh key prefix, so tests do not see each other."""

    supports_capacity = False  # the Mooncake master evicts on its own; capacity is advisory

    @pytest.fixture(autouse=True)
    def _cluster(self, mooncake_cluster: MooncakeCluster) -> Iterator[None]:
        self.cluster = mooncake_cluster
        yield

    async def make_tier(self, tmp_path: Path, capacity_bytes: int) -> Tier:
        return make_tier(self.cluster, capacity_bytes=capacity_bytes)


# ---------------------------------------------------------------------- behaviour
@needs_mooncake
@pytest.mark.anyio
async def test_round_trip_several_objects_byte_exact(mooncake_cluster: MooncakeCluster) -> None:
    keys = make_keys(5)
    sizes = [4096, 1, 3 * 4096 + 5, 3 << 20, 0]  # 3 MiB grows the bounce buffers

    tier = make_tier(mooncake_cluster)
    async with tier:
        for i, (k, n) in enumerate(zip(keys, sizes)):
            src = torch.from_numpy(payload(i, n)) if i % 2 else payload(i, n).tobytes()
            assert await tier.write(k, "kv", src) is True
        for i, (k, n) in enumerate(zip(keys, sizes)):
            dst = torch.zeros(n + 100, dtype=torch.uint8)
            assert await tier.read_into(k, "kv", dst) == n
            assert bytes(dst[:n].numpy()) == payload(i, n).tobytes()
            assert not dst[n:].any()
        s = tier.statistics()
        assert (s.writes, s.reads, s.hits, s.objects) == (5, 5, 5, 5)
        assert s.bytes_written == s.bytes_read == sum(sizes)
        assert s.bytes == sum(sizes) + 5 * HEADER_SIZE


class _Recorder:
    """Proxy around the store client that records which methods the tier calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self._inner, name)


@needs_mooncake
@pytest.mark.anyio
async def test_contains_many_is_metadata_only(mooncake_cluster: MooncakeCluster) -> None:
    keys = make_keys(6)

    tier = make_tier(mooncake_cluster)
    async with tier:
        for k in keys[::2]:
            await tier.write(k, "kv", payload(1))
        rec = _Recorder(tier._store)
        tier._store = rec
        before = tier.statistics()
        got = await tier.contains_many([ObjectKey(k, g) for k in keys for g in ("kv", "aux")])
        assert got == [i % 2 == 0 and g == "kv" for i in range(6) for g in ("kv", "aux")]
        assert rec.calls == ["batch_is_exist"]  # one batched metadata call, no payload read
        after = tier.statistics()
        assert (after.reads, after.bytes_read) == (before.reads, before.bytes_read)
        assert await tier.contains_many([]) == []


@needs_mooncake
@pytest.mark.anyio
async def test_missing_key_is_object_not_found(mooncake_cluster: MooncakeCluster) -> None:
    k = make_keys(1)[0]

    tier = make_tier(mooncake_cluster)
    async with tier:
        dst = np.zeros(4096, dtype=np.uint8)
        with pytest.raises(ObjectNotFoundError) as ei:
            await tier.read_into(k, "kv", dst)
        assert ei.value.fields["code"] == -704
        assert not dst.any()
        assert await tier.delete(k, "kv") is False
        assert tier.statistics().misses == 1


@needs_mooncake
@pytest.mark.anyio
async def test_put_existing_returns_false_and_keeps_old_value(
    mooncake_cluster: MooncakeCluster,
) -> None:
    k = make_keys(1)[0]

    tier = make_tier(mooncake_cluster)
    async with tier:
        assert await tier.write(k, "kv", payload(1, 8192)) is True
        assert await tier.write(k, "kv", payload(2, 8192)) is False
        assert await tier.write(k, "kv", payload(3, 100)) is False
        dst = np.zeros(8192, dtype=np.uint8)
        assert await tier.read_into(k, "kv", dst) == 8192
        assert np.array_equal(dst, payload(1, 8192))
        assert tier.statistics().writes == 1


@needs_mooncake
@pytest.mark.anyio
async def test_corrupt_values_are_detected(mooncake_cluster: MooncakeCluster) -> None:
    keys = make_keys(4)

    tier = make_tier(mooncake_cluster)
    async with tier:

        def good(k: ChunkKey) -> bytes:
            return encode_object(ObjectKey(k, "kv"), payload(0, 8192))[: HEADER_SIZE + 8192]

        # a flipped payload byte, written directly through the store client
        bad = bytearray(good(keys[0]))
        bad[HEADER_SIZE + 100] ^= 0x01
        assert put_raw_stored(tier, keys[0], "kv", bytes(bad))
        # junk without a bsr header
        assert put_raw_stored(tier, keys[1], "kv", os.urandom(HEADER_SIZE + 8192))
        # a flipped header byte (header checksum)
        bad = bytearray(good(keys[2]))
        bad[40] ^= 0x80
        assert put_raw_stored(tier, keys[2], "kv", bytes(bad))
        for k in keys[:3]:
            dst = np.zeros(8192, dtype=np.uint8)
            with pytest.raises(CorruptObjectError):  # the check refuses what the store moved
                await tier.read_into(k, "kv", dst)
        # a truncated object (header intact, half the payload)
        assert put_raw_stored(tier, keys[3], "kv", good(keys[3])[: HEADER_SIZE + 4096])
        with pytest.raises(TruncatedObjectError):
            await tier.read_into(keys[3], "kv", np.zeros(8192, dtype=np.uint8))
        assert tier.statistics().errors == 4


@needs_mooncake
@pytest.mark.anyio
async def test_foreign_namespace_object_is_detected(mooncake_cluster: MooncakeCluster) -> None:
    mine = make_keys(1, model="mine")[0]
    # same digest and index (so the same object id and store key), another namespace
    theirs = ChunkKey(mine.digest, mine.index, make_keys(1, model="theirs")[0].namespace)

    tier = make_tier(mooncake_cluster)
    async with tier:
        blob = encode_object(ObjectKey(theirs, "kv"), payload(5, 4096))
        assert tier.store_key(mine, "kv") == tier.store_key(theirs, "kv")
        assert put_raw_stored(tier, mine, "kv", blob)
        assert await tier.contains_many([ObjectKey(mine, "kv")]) == [True]
        with pytest.raises(ForeignObjectError):
            await tier.read_into(mine, "kv", np.zeros(4096, dtype=np.uint8))


@needs_mooncake
@pytest.mark.anyio
async def test_too_small_destination_is_config_error_and_keeps_object(
    mooncake_cluster: MooncakeCluster,
) -> None:
    k = make_keys(1)[0]

    tier = make_tier(mooncake_cluster)
    async with tier:
        await tier.write(k, "kv", payload(1, 3 * 4096))
        with pytest.raises(ConfigError, match="destination holds 4096 bytes"):
            await tier.read_into(k, "kv", np.zeros(4096, dtype=np.uint8))
        dst = np.zeros(3 * 4096, dtype=np.uint8)
        assert await tier.read_into(k, "kv", dst) == 3 * 4096
        assert np.array_equal(dst, payload(1, 3 * 4096))


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        MooncakeTier()
    with pytest.raises(ConfigError, match="exactly one"):
        MooncakeTier(master_address="127.0.0.1:1", client_address="127.0.0.1:2")
    with pytest.raises(ConfigError, match="host:port"):
        MooncakeTier(master_address="localhost")
    with pytest.raises(ConfigError, match="timeout_s"):
        MooncakeTier(master_address="127.0.0.1:1", timeout_s=0)
    with pytest.raises(ConfigError, match="protocol"):
        MooncakeTier(master_address="127.0.0.1:1", protocol="udp")


@needs_mooncake
@pytest.mark.anyio
async def test_unreachable_address_fails_fast() -> None:
    require_mooncake()

    import socket

    async def main(port: int) -> None:
        tier = MooncakeTier(master_address=f"127.0.0.1:{port}", timeout_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(TierIOError, match="cannot reach the Mooncake master"):
            await tier.open()
        assert time.monotonic() - t0 < 2.0 + MARGIN_S
        await tier.aclose()

    # a port this test holds without listening: nothing else can take it meanwhile
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        await main(held.getsockname()[1])


@needs_mooncake
@pytest.mark.anyio
async def test_cluster_and_test_process_listen_on_loopback_only(
    mooncake_cluster: MooncakeCluster,
) -> None:
    psutil = pytest.importorskip("psutil")
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

    def listeners(pid: int) -> set[tuple[str, int]]:
        conns = psutil.Process(pid).net_connections(kind="inet")
        return {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}

    for name, pid in mooncake_cluster.pids.items():
        socks = listeners(pid)
        assert socks, name
        assert {ip for ip, _ in socks} <= loopback, (name, socks)

    before = listeners(os.getpid())
    tier = make_tier(mooncake_cluster)
    async with tier:
        await tier.write(make_keys(1)[0], "kv", payload(0, 4096))
        assert listeners(os.getpid()) == before  # standalone mode opens no listener


# ---------------------------------------------------------------------- embedded mode
_EMBEDDED_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import anyio, numpy as np, psutil
    from bsr._errors import ObjectNotFoundError, ForeignObjectError, TierTimeoutError
    from bsr.core._keys import ChunkKey, ObjectKey
    from bsr.tiers._mooncake import MooncakeTier
    from bsr.testing import make_keys, payload

    master, master_pid = sys.argv[1], int(sys.argv[2])
    out = {}

    async def main():
        keys = make_keys(3)
        tier = MooncakeTier(master_address=master, metadata_server="P2PHANDSHAKE",
                            protocol="tcp", timeout_s=1.0, key_prefix=MooncakeTier.unique_prefix())
        async with tier:
            out["write"] = [
                await tier.write(k, "kv", payload(i, 2 << 20)) for i, k in enumerate(keys)
            ]
            out["rewrite"] = await tier.write(keys[0], "kv", payload(9, 4096))
            ok = []
            for i, k in enumerate(keys):
                dst = np.zeros(2 << 20, dtype=np.uint8)
                n = await tier.read_into(k, "kv", dst)
                ok.append(n == 2 << 20 and bool(np.array_equal(dst, payload(i, 2 << 20))))
            out["read_ok"] = ok
            out["contains"] = await tier.contains_many(
                [ObjectKey(keys[0], "kv"), ObjectKey(keys[0], "aux")])
            try:
                await tier.read_into(keys[0], "aux", np.zeros(4096, dtype=np.uint8))
            except ObjectNotFoundError:
                out["missing"] = "ObjectNotFoundError"
            try:
                await tier.read_into(ChunkKey(keys[1].digest, keys[1].index, bytes(16)), "kv",
                                     np.zeros(2 << 20, dtype=np.uint8))
            except ForeignObjectError:
                out["foreign"] = "ForeignObjectError"
            conns = psutil.Process().net_connections(kind="inet")
            listening = {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
            out["listen_ips"] = sorted(listening)
            os.kill(master_pid, 9)
            t0 = time.monotonic()
            for _ in range(2):  # the first call may see the reset connection at once
                t0 = time.monotonic()
                try:
                    await tier.read_into(keys[0], "kv", np.zeros(2 << 20, dtype=np.uint8))
                    res = ("no error", None)
                except Exception as exc:
                    res = (type(exc).__name__, getattr(exc, "code", None))
                out.setdefault("dead_master", []).append([*res, time.monotonic() - t0])

    anyio.run(main)
    print("RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # do not wait for the abandoned store thread
    """
)


@needs_mooncake
def test_embedded_mode_in_subprocess(fresh_mooncake_cluster: MooncakeCluster) -> None:
    c = fresh_mooncake_cluster
    res = subprocess.run(
        [sys.executable, "-c", _EMBEDDED_SCRIPT, c.master_address, str(c.pids["master"])],
        env=c.subprocess_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    detail = f"rc={res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 0 and lines, detail
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["write"] == [True, True, True]
    assert out["rewrite"] is False
    assert out["read_ok"] == [True, True, True]
    assert out["contains"] == [True, False]
    assert out["missing"] == "ObjectNotFoundError"
    assert out["foreign"] == "ForeignObjectError"
    assert set(out["listen_ips"]) <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, out["listen_ips"]
    for name, code, elapsed in out["dead_master"]:
        # a killed master: an unreachable-master error (RPC_FAIL) or the tier's own timeout
        assert (name, code) in {("TierTimeoutError", None), ("TierIOError", -900)}, out
        assert elapsed < 1.0 + MARGIN_S, out


# ---------------------------------------------------------------------- faults
@needs_mooncake
@pytest.mark.anyio
async def test_dead_master_gives_timeout_not_hang(fresh_mooncake_cluster: MooncakeCluster) -> None:
    c = fresh_mooncake_cluster
    keys = make_keys(2)

    prefix = MooncakeTier.unique_prefix()
    async with make_tier(c, key_prefix=prefix) as setup:  # a busy machine's setup takes > 1 s
        await setup.write(keys[0], "kv", payload(0, 4096))
    tier = make_tier(c, timeout_s=1.0, key_prefix=prefix)
    async with tier:
        assert await tier.contains_many([ObjectKey(keys[0], "kv")]) == [True]
        c.kill_master()
        for op in ("read", "contains", "write"):
            t0 = time.monotonic()
            # the tier's timeout fires while the gateway retries the dead master; a call
            # that sees the reset connection first is an RPC_FAIL (-900) TierIOError
            with pytest.raises((TierTimeoutError, TierIOError)) as ei:
                if op == "read":
                    await tier.read_into(keys[0], "kv", np.zeros(4096, dtype=np.uint8))
                elif op == "contains":
                    await tier.contains_many([ObjectKey(keys[0], "kv")])
                else:
                    await tier.write(keys[1], "kv", payload(1, 4096))
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0 + MARGIN_S, (op, elapsed)
            if not isinstance(ei.value, TierTimeoutError):
                assert ei.value.fields["code"] == -900, ei.value
        assert tier.statistics().errors == 3


@needs_mooncake
@pytest.mark.anyio
async def test_hung_master_times_out_and_recovers(frozen_master_cluster: MooncakeCluster) -> None:
    c = frozen_master_cluster
    k = make_keys(1)[0]

    prefix = MooncakeTier.unique_prefix()
    async with make_tier(c, key_prefix=prefix) as setup:  # a busy machine's setup takes > 1 s
        await setup.write(k, "kv", payload(0, 4096))
    tier = make_tier(c, timeout_s=1.0, max_stuck_calls=2, key_prefix=prefix)
    async with tier:
        c.pause_master()
        try:
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(TierTimeoutError):
                    await tier.contains_many([ObjectKey(k, "kv")])
                assert time.monotonic() - t0 < 1.0 + MARGIN_S
            # two calls are stuck in the frozen master: a next one fails fast. The Mooncake
            # client may give up on a hung RPC by itself (its own RPC timeout), which returns a
            # stuck call: then another call times out and is stuck in its place; a few more
            # calls must reach the bound, each ending in its timeout or failing fast
            for _ in range(4):
                t0 = time.monotonic()
                abandoned = tier._calls.abandoned
                try:
                    await tier.contains_many([ObjectKey(k, "kv")])
                except TierTimeoutError:
                    assert time.monotonic() - t0 < 1.0 + MARGIN_S
                    continue
                except TierIOError as e:
                    assert "unresponsive" in str(e), e
                    # refused at once, not after its timeout: no worker ran it, so none was
                    # abandoned (a wall-clock bound of the timeout itself failed on a busy
                    # machine: 1.3 s for a refusal that never left the event loop)
                    assert tier._calls.abandoned == abandoned
                    break
                pytest.fail("contains_many answered while the master is paused")
            else:
                pytest.fail("no call failed fast with two or more calls stuck in the master")
        finally:
            c.resume_master()
        # the stuck calls drain once the master answers again; the tier works again
        with anyio.fail_after(30):
            while tier._calls.stuck:  # noqa: ASYNC110 - polling a counter of another thread
                await anyio.sleep(0.05)
        dst = np.zeros(4096, dtype=np.uint8)
        assert await tier.read_into(k, "kv", dst) == 4096
        assert np.array_equal(dst, payload(0, 4096))


@pytest.mark.slow
@needs_mooncake
@pytest.mark.parametrize("how", ["skipped", "restarted"])
@pytest.mark.parametrize("taken", ["master", "memory", "gateway"])
# what is tested is the cluster launcher's ports: one backend (the tier's own behaviour with a
# frozen master runs under both in test_hung_master_times_out_and_recovers)
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_cluster_owns_its_ports_when_a_chosen_port_is_taken(
    monkeypatch: pytest.MonkeyPatch, taken: str, how: str
) -> None:
    """Issue 19 item 11, the flake made deterministic: another process listens on the port the
    fixture picks for one of its processes. The cluster must come up on ports its own PIDs
    listen on, take writes, and freezing its master must hang the tier (before: the readiness
    check accepted the stranger's port, the master died on EADDRINUSE and pause_master froze
    nothing). ``skipped``: the launcher sees the listener and picks another port; ``restarted``:
    it is blinded to listeners, so the process starts, cannot bind, and the whole cluster is
    started again on fresh ports."""
    import socket

    from bsr.testing import _mooncake_cluster as mc
    from bsr.testing import _ports, listening_ports

    require_mooncake()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        # the n-th port the launcher asks for is the taken one: master rpc is the 1st (its
        # metrics port the 2nd), the memory holder's the 3rd, the gateway's the 4th
        nth = {"master": 0, "memory": 2, "gateway": 3}[taken]
        real, calls = _ports.free_port, itertools.count()
        monkeypatch.setattr(_ports, "free_port", lambda: port if next(calls) == nth else real())
        if how == "restarted":
            monkeypatch.setattr(_ports, "port_listeners", lambda p: set())
        with mc.start_cluster(client_ttl_s=3) as c:
            assert next(calls) > 4  # the taken port was handed out, then replaced
            for name, proc in c.procs.items():
                assert proc.alive() and proc.port != port, name
                assert proc.port in listening_ports(proc.pid), name
            assert c.master_address == f"127.0.0.1:{c.procs['master'].port}"
            assert c.client_address == f"127.0.0.1:{c.procs['gateway'].port}"
            keys = make_keys(4)

            def master_state() -> str:  # "T": stopped
                return Path(f"/proc/{c.pids['master']}/stat").read_text().rsplit(") ", 1)[1][0]

            # as test_hung_master_times_out_and_recovers, with room for writes under load
            async with make_tier(c, timeout_s=3.0) as tier:
                for i, k in enumerate(keys):  # every segment the master knows is alive
                    assert await tier.write(k, "kv", payload(i, 4096))
                c.pause_master()
                state = master_state()
                assert state == "T"  # pause_master returns once the master is stopped
                t0 = time.monotonic()
                try:
                    got = await tier.contains_many([ObjectKey(k, "kv") for k in keys])
                except TierTimeoutError:
                    pass
                else:
                    pytest.fail(
                        f"the tier answered {got} in {time.monotonic() - t0:.3f} s with the "
                        f"master stopped (state {state})"
                    )
                finally:
                    c.resume_master()
        # stopped by PID: none of its processes is left
        assert all(not p.alive() for p in c.procs.values())


def test_wait_listening_tells_a_strangers_port_from_its_own(tmp_path: Path) -> None:
    """The launcher's building block, on plain processes: a process that does not listen
    while another holds the port -> PortTaken; one that exits -> ProcessExited; one that
    listens -> returns, and listening_ports names its port by its PID."""
    import socket

    from bsr.testing import PortTaken, listening_ports, wait_listening
    from bsr.testing._ports import ProcessExited

    def spawn(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        assert port in listening_ports(os.getpid())
        idle = spawn("import time; time.sleep(60)")
        try:
            with pytest.raises(PortTaken):
                wait_listening(idle, port, time.monotonic() + 60, "idle")
        finally:
            idle.kill()
            idle.wait()
    gone = spawn("pass")
    with pytest.raises(ProcessExited):
        wait_listening(gone, port, time.monotonic() + 60, "gone")
    ready = tmp_path / "port"
    server = spawn(
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        f"open({str(ready)!r}, 'w').write(str(s.getsockname()[1])); time.sleep(60)"
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        own = int(ready.read_text())
        wait_listening(server, own, deadline, "server")
        assert own in listening_ports(server.pid) and own not in listening_ports(os.getpid())
    finally:
        server.kill()
        server.wait()


@needs_mooncake
@pytest.mark.anyio
async def test_memory_process_killed_reads_fail_typed(
    fresh_mooncake_cluster: MooncakeCluster,
) -> None:
    c = fresh_mooncake_cluster
    keys = make_keys(3)

    tier = make_tier(c, timeout_s=3.0)
    async with tier:
        for i, k in enumerate(keys):
            await tier.write(k, "kv", payload(i, 8192))
        c.kill_memory()
        for k in keys:
            dst = np.zeros(8192, dtype=np.uint8)
            t0 = time.monotonic()
            with pytest.raises(TierError) as ei:
                await tier.read_into(k, "kv", dst)
            assert time.monotonic() - t0 < 3.0 + MARGIN_S
            assert isinstance(ei.value, BsrError)
            assert not dst.any()
        # once the master drops the dead client's segment (client_ttl=3 s), it is a miss
        with anyio.fail_after(30):
            while (await tier.contains_many([ObjectKey(keys[0], "kv")])) != [False]:  # noqa: ASYNC110
                await anyio.sleep(0.5)
        with pytest.raises(ObjectNotFoundError):
            await tier.read_into(keys[0], "kv", np.zeros(8192, dtype=np.uint8))


# ---------------------------------------------------------------------- fake store (no Mooncake)
class _FakeStore:
    """Just enough of MooncakeDistributedStore, in process, with a gate to freeze calls."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.frozen = threading.Event()  # set: get_into / batch_is_exist block on `gate`
        self.gate = threading.Event()
        self.late_writes = 0
        self.inside = threading.Event()  # a call is blocked on the gate now
        self.opened: list[bool] = []  # per blocked call: the gate opened (True) or it timed out

    def _maybe_block(self) -> None:
        if self.frozen.is_set():
            self.inside.set()
            self.opened.append(self.gate.wait(30))
            self.inside.clear()

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def is_exist(self, key: str) -> int:
        return int(key in self.objects)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._maybe_block()
        return [int(k in self.objects) for k in keys]

    def put_from(self, key: str, ptr: int, size: int) -> int:
        self.objects.setdefault(key, ctypes.string_at(ptr, size))
        return 0

    def get_into(self, key: str, ptr: int, size: int) -> int:
        blocked = self.frozen.is_set()
        self._maybe_block()
        blob = self.objects.get(key)
        if blob is None:
            return -704
        if len(blob) > size:
            return -600
        ctypes.memmove(ptr, blob, len(blob))  # after a timeout: the late transfer
        self.late_writes += blocked
        return len(blob)

    def get_size(self, key: str) -> int:
        blob = self.objects.get(key)
        return -704 if blob is None else len(blob)

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self.objects.pop(key, None) is not None else -704

    def close(self) -> int:
        return 0


def fake_tier(**kw: Any) -> tuple[MooncakeTier, _FakeStore]:
    tier = MooncakeTier(master_address="127.0.0.1:1", **kw)
    store = _FakeStore()
    tier._store = store  # as open() would, without a cluster
    tier._opened = True
    return tier, store


async def _wait_unstuck(tier: MooncakeTier) -> None:
    with anyio.fail_after(10):
        while tier._calls.stuck:  # noqa: ASYNC110 - polling a counter of another thread
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_timed_out_read_never_writes_into_the_destination() -> None:
    tier, store = fake_tier(timeout_s=0.2)
    k = make_keys(1)[0]
    # the setup write through a tier with a generous timeout on the same store: 0.2 s is for
    # the read under test (a write at 0.2 s timed out once at load average 17)
    writer, _ = fake_tier(timeout_s=60.0)
    writer._store = store
    await writer.write(k, "kv", payload(1, 8192))
    await writer.aclose()
    store.frozen.set()
    dst = np.zeros(8192, dtype=np.uint8)
    t0 = time.monotonic()
    with pytest.raises(TierTimeoutError):
        await tier.read_into(k, "kv", dst)
    assert time.monotonic() - t0 < 0.2 + MARGIN_S
    assert tier._calls.stuck == 1
    # the caller reuses its slot at once; then the frozen transfer completes late
    dst[:] = 7
    store.frozen.clear()
    store.gate.set()
    await _wait_unstuck(tier)
    assert store.late_writes == 1
    assert (dst == 7).all()  # the late bytes landed in the tier's bounce buffer only
    # the bounce buffer went back to the pool and serves the next read correctly
    out = np.zeros(8192, dtype=np.uint8)
    assert await tier.read_into(k, "kv", out) == 8192
    assert np.array_equal(out, payload(1, 8192))
    assert len(tier._all_bounces) == len(tier._idle) == 1
    await tier.aclose()


@pytest.mark.anyio
async def test_store_calls_do_not_block_the_event_loop() -> None:
    """A store call runs off the event loop. Shown by logic, not by timing: the call blocks on a
    gate that only a task on the event loop opens, after seeing the call inside the store for
    three of its own ticks. Were the loop blocked by the call, the gate would never open (the
    call gives up after 30 s) and ``opened`` would say so."""
    tier, store = fake_tier(timeout_s=60.0)

    async def opener() -> None:
        seen = 0
        while seen < 3:
            await anyio.sleep(0.01)
            seen += store.inside.is_set()
        store.gate.set()

    store.frozen.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(opener)
        assert await tier.contains_many([ObjectKey(make_keys(1)[0], "kv")]) == [False]
    assert store.opened == [True]  # the loop opened the gate while the call was inside
    await tier.aclose()


@pytest.mark.anyio
async def test_stuck_calls_are_bounded_and_cancellation_before_start_is_not_stuck() -> None:
    # 2 s: time for a loaded machine to start the worker thread before the call times out
    # (a call that times out before its store call starts is, rightly, not stuck)
    tier, store = fake_tier(timeout_s=2.0, max_stuck_calls=2, max_inflight=1)
    k = ObjectKey(make_keys(1)[0], "kv")

    store.frozen.set()
    for _ in range(2):
        with pytest.raises(TierTimeoutError):
            await tier.contains_many([k])
    assert tier._calls.stuck == 2
    t0 = time.monotonic()
    with pytest.raises(TierIOError, match="unresponsive"):
        await tier.contains_many([k])
    assert time.monotonic() - t0 < 1.0  # refused at once, not after the 2 s timeout
    store.frozen.clear()
    store.gate.set()
    await _wait_unstuck(tier)
    assert await tier.contains_many([k]) == [False]
    # a call cancelled while it waits for the (single) slot never starts a store call
    store.gate.clear()
    store.frozen.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tier.contains_many, [k])
        await anyio.sleep(0.05)
        with anyio.move_on_after(0.05):
            await tier.contains_many([k])
        tg.cancel_scope.cancel()
    assert tier._calls.stuck <= 1
    store.frozen.clear()
    store.gate.set()
    await _wait_unstuck(tier)
    await tier.aclose()


@pytest.mark.anyio
async def test_open_without_mooncake_package_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails

    tier = MooncakeTier(master_address="127.0.0.1:1")
    with pytest.raises(ConfigError, match="libibverbs1"):
        await tier.open()
