"""bsr.sglang's guarantees, and equality with SGLang's own file backend (``HiCacheFile``).

Runs in .venv-sglang; skipped where SGLang is not installed. Real files, a real bsr engine.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import bsr  # noqa: E402
from bsr.sglang import BsrHiCacheStorage  # noqa: E402
from support.engines import HangingContains  # noqa: E402

KEYS = [f"k{i}" for i in range(6)]
SRC, DST = [0, 1, 2, 3], [8, 9, 10, 11]  # host pages written from, and restored into


@pytest.fixture
def backends():
    made: list[BsrHiCacheStorage] = []

    def make(config, pool) -> BsrHiCacheStorage:
        b = BsrHiCacheStorage(config, {})
        b.register_mem_pool_host(pool)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _seed(key: str) -> int:
    return 1000 + KEYS.index(key) if key in KEYS else hash(key) % 10_000


def _file_get(file, pool, keys, pages, ps) -> int:
    """SGLang's cache controller's generic page get (``_generic_page_get``) over HiCacheFile."""
    data = file.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    count = 0
    for i, page in enumerate(data):
        if page is None:
            break
        pool.set_from_flat_data_page(pages[i] * ps, page)
        count += 1
    return count


keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True)
ops_st = st.lists(
    st.tuples(st.sampled_from(["set", "exists", "get"]), keys_st), min_size=1, max_size=8
)


@settings(max_examples=12, deadline=None)
@given(ops=ops_st)
def test_same_pages_and_counts_as_hicache_file(sg: SimpleNamespace, ops) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ours_pool, file_pool = sg.mha_pool(), sg.mha_pool()
        config = sg.storage_config(root / "bsr")
        config.extra_config["file_storage_path"] = str(root / "file")
        file = hicache.HiCacheFile(config)
        ours = BsrHiCacheStorage(config, {})
        ours.register_mem_pool_host(ours_pool)
        ps = ours_pool.page_size
        try:
            for op, keys in ops:
                pages = SRC[: len(keys)] if op == "set" else DST[: len(keys)]
                if op == "set":
                    for k, p in zip(keys, pages):
                        sg.fill_page(ours_pool, p, _seed(k))
                        sg.fill_page(file_pool, p, _seed(k))
                    data = [file_pool.get_data_page(p * ps) for p in pages]
                    assert file.batch_set(keys, data) is True
                    assert ours.batch_set_v1(keys, sg.indices(ours_pool, pages)) == [True] * len(
                        keys
                    )
                elif op == "exists":
                    assert ours.batch_exists(keys) == file.batch_exists(keys)
                else:
                    got = ours.batch_get_v1(keys, sg.indices(ours_pool, pages))
                    n = _file_get(file, file_pool, keys, pages, ps)
                    assert got == [True] * n + [False] * (len(keys) - n)
                    assert torch.equal(ours_pool.kv_buffer, file_pool.kv_buffer)
        finally:
            ours.close()


def _object_of(root: Path, before: set[Path]) -> Path:
    (new,) = {p for p in root.rglob("*.bsr") if p.is_file()} - before
    return new


def test_a_corrupt_object_ends_the_run_and_is_quarantined(tmp_path, sg, backends) -> None:
    pool = sg.mha_pool()
    b = backends(sg.storage_config(tmp_path), pool)
    objects = []
    for i, key in enumerate(["a", "b", "c", "d"]):
        sg.fill_page(pool, i, 10 + i)
        before = set(tmp_path.rglob("*.bsr"))
        assert b.batch_set_v1([key], sg.indices(pool, [i])) == [True]
        objects.append(_object_of(tmp_path, before))
    page_c = pool.get_data_page(2 * pool.page_size).view(torch.uint8).numpy().tobytes()
    blob = bytearray(objects[2].read_bytes())
    at = blob.find(page_c)
    assert at > 0  # the payload is the flat page
    blob[at + 7] ^= 0xFF
    objects[2].write_bytes(bytes(blob))

    pool.kv_buffer[:, 8 * pool.page_size :] = 3  # the pages restored into
    mark = pool.get_data_page(10 * pool.page_size).clone()
    assert b.batch_exists(["a", "b", "c", "d"]) == 4  # metadata only: not read yet
    got = b.batch_get_v1(["a", "b", "c", "d"], sg.indices(pool, [8, 9, 10, 11]))
    assert got == [True, True, False, False]
    assert torch.equal(pool.get_data_page(10 * pool.page_size), mark)  # never written
    assert torch.equal(pool.get_data_page(11 * pool.page_size), mark)  # never read
    assert b.get_stats().bsr.quarantined == 1
    assert b.batch_exists(["a", "b", "c", "d"]) == 2  # the quarantined object no longer counts
    assert any((tmp_path / "quarantine").iterdir())


def test_extra_key_and_cache_salt_keep_requests_apart(tmp_path, sg, backends) -> None:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    class Key(list):  # SGLang's RadixKey: token ids with extra_key (and cache_salt)
        def __init__(self, ids, extra_key=None, cache_salt=None):
            super().__init__(ids)
            self.extra_key, self.cache_salt = extra_key, cache_salt

    pool = sg.mha_pool()
    b = backends(sg.storage_config(tmp_path), pool)
    ids = list(range(3 * pool.page_size))
    chains = [
        get_storage_hash_str(Key(ids, *kw), page_size=pool.page_size)
        for kw in [(), ("lora-a",), ("lora-b",), (None, "salt-1"), ("lora-a", "salt-1")]
    ]
    assert len({c[0] for c in chains}) == len(chains)
    for p in range(3):
        sg.fill_page(pool, p, p)
    assert b.batch_set_v1(chains[1], sg.indices(pool, [0, 1, 2])) == [True] * 3
    assert [b.batch_exists(c) for c in chains] == [0, 3, 0, 0, 0]


def test_tenants_models_and_mha_ranks_never_share(tmp_path, sg, backends) -> None:
    pool = sg.mha_pool()
    writer = backends(sg.storage_config(tmp_path, tp_rank=0, tp_size=2, tenant="t1"), pool)
    sg.fill_page(pool, 0, 1)
    assert writer.batch_set_v1(["h"], sg.indices(pool, [0])) == [True]
    same = sg.storage_config(tmp_path, tp_rank=0, tp_size=2, tenant="t1")
    others = [
        sg.storage_config(tmp_path, tp_rank=1, tp_size=2, tenant="t1"),
        sg.storage_config(tmp_path, tp_rank=0, tp_size=4, tenant="t1"),
        sg.storage_config(tmp_path, tp_rank=0, tp_size=2, tenant="t2"),
        sg.storage_config(tmp_path, tp_rank=0, tp_size=2, tenant="t1", model="org/other"),
    ]
    assert backends(same, sg.mha_pool()).batch_exists(["h"]) == 1
    assert [backends(c, sg.mha_pool()).batch_exists(["h"]) for c in others] == [0] * 4


def test_mla_pages_are_shared_by_tp_ranks(tmp_path, sg, backends) -> None:
    pool = sg.mla_pool()
    writer = backends(sg.storage_config(tmp_path, tp_rank=0, tp_size=2, mla=True), pool)
    want = sg.fill_page(pool, 0, 5)
    assert writer.batch_set_v1(["h"], sg.indices(pool, [0])) == [True]
    reader_pool = sg.mla_pool()
    reader = backends(sg.storage_config(tmp_path, tp_rank=1, tp_size=2, mla=True), reader_pool)
    assert reader.batch_get_v1(["h"], sg.indices(reader_pool, [4])) == [True]
    assert torch.equal(reader_pool.get_data_page(4 * reader_pool.page_size), want)
    mha = backends(sg.storage_config(tmp_path, tp_rank=1, tp_size=2), sg.mha_pool())
    assert mha.batch_exists(["h"]) == 0  # an MHA model never reads MLA pages


def test_staging_stays_within_the_window(tmp_path, sg, backends) -> None:
    pool = sg.mha_pool(pages=32)
    b = backends(sg.storage_config(tmp_path, window=2), pool)
    keys = [f"p{i}" for i in range(16)]
    for p in range(16):
        sg.fill_page(pool, p, p)
    assert b.batch_set_v1(keys, sg.indices(pool, range(16))) == [True] * 16
    assert b.batch_get_v1(keys, sg.indices(pool, range(16, 32))) == [True] * 16
    staging = b.get_stats().bsr.staging
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    assert (staging.slots, staging.slot_bytes) == (2, b.pages.layout.slot_bytes)
    assert page_bytes <= staging.slot_bytes < page_bytes + 4096  # one page (aligned) per slot
    assert 1 <= staging.peak_in_use <= 2


class FileTierMayHang(BsrHiCacheStorage):
    """The backend with its file tier behind :class:`HangingContains` (``wrap_tiers``)."""

    def wrap_tiers(self, tiers: list[bsr.Tier]) -> list[bsr.Tier]:
        self.file = HangingContains(next(t for t in tiers if t.name == "file"))
        return [self.file if t.name == "file" else t for t in tiers]


def _exists_within(b: BsrHiCacheStorage, keys: list[str], seconds: float = 60) -> int:
    """``batch_exists`` from another thread (SGLang's prefetch thread calls it); fails if it has
    not answered within ``seconds`` (a hang guard: the bound under test is 2 s a page)."""
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(b.batch_exists(keys)), daemon=True)
    t.start()
    t.join(seconds)
    assert got, f"batch_exists did not answer within {seconds} s"
    return got[0]


@pytest.mark.parametrize("with_host", [True, False])
def test_a_hung_tier_is_cut_off_at_lookup_timeout_s(tmp_path, sg, with_host) -> None:
    """A file tier on a hung mount: each page's lookup is bounded by
    ``bsr_backend.lookup_timeout_s``, the pages a host tier above it holds still count, and
    the hung tier's circuit breaker (threshold 2) opens, so the next lookups skip it. Before the
    bound, ``batch_exists`` waited on the hung tier for ever (SGLang's prefetch thread with it)."""
    tiers = [{"kind": "file", "path": str(tmp_path), "capacity_bytes": "64MiB"}]
    if with_host:
        tiers.insert(0, {"kind": "host", "capacity_bytes": "16MiB"})
    config = sg.storage_config(tmp_path, tiers=tiers)
    config.extra_config["bsr"].update(breaker_threshold=2, breaker_cooldown_s=600)
    # the default, ample for the host tier's answer on a busy machine
    config.extra_config["bsr_backend"] = {"lookup_timeout_s": 2.0}
    pool = sg.mha_pool()
    b = FileTierMayHang(config, {})
    try:
        b.register_mem_pool_host(pool)
        for p in range(4):
            sg.fill_page(pool, p, p)
        assert b.batch_set_v1(KEYS[:4], sg.indices(pool, SRC)) == [True] * 4
        assert _exists_within(b, KEYS[:4]) == 4  # control: nothing hangs
        b.file.hang = True
        held = 4 if with_host else 0
        assert _exists_within(b, KEYS[:4]) == held  # each page's lookup cut off
        assert _exists_within(b, KEYS[:4]) == held
        assert b.engine is not None
        assert b.engine.health.state("file").open  # cut off twice: skipped from now on
        assert _exists_within(b, KEYS[:4]) == held
        if with_host:
            assert b.batch_get_v1(KEYS[:4], sg.indices(pool, DST)) == [True] * 4
    finally:
        b.file.hang = False
        b.close()


def _get_within(b: BsrHiCacheStorage, keys: list[str], pages: list[int], pool, sg, seconds=60):
    """``batch_get_v1`` from another thread (SGLang's prefetch thread); None if it has not
    answered within ``seconds`` (a hang guard, not a timing claim)."""
    got: list[list[bool]] = []
    t = threading.Thread(
        target=lambda: got.append(b.batch_get_v1(keys, sg.indices(pool, pages))), daemon=True
    )
    t.start()
    t.join(seconds)
    return got[0] if got else None


def _hung_below_host(tmp_path, sg, **backend):
    """A backend over a host tier and a file tier whose lookups hang on demand, with a breaker
    that stays closed (threshold 10: every call asks the file tier while it is not skipped),
    two pages saved from SRC; ``backend``: its ``bsr_backend`` options."""
    tiers = [
        {"kind": "host", "capacity_bytes": "16MiB"},
        {"kind": "file", "path": str(tmp_path), "capacity_bytes": "64MiB"},
    ]
    config = sg.storage_config(tmp_path, tiers=tiers)
    config.extra_config["bsr"].update(breaker_threshold=10, breaker_cooldown_s=600)
    config.extra_config["bsr_backend"] = {"lookup_timeout_s": 2.0, **backend}
    pool = sg.mha_pool()
    b = FileTierMayHang(config, {})
    b.register_mem_pool_host(pool)
    want = [sg.fill_page(pool, p, p) for p in SRC[:2]]
    assert b.batch_set_v1(KEYS[:2], sg.indices(pool, SRC[:2])) == [True, True]
    return b, pool, want


def _close_unless_stuck(b: BsrHiCacheStorage, got) -> None:
    b.file.hang = False
    if got is not None:  # a get still stuck on the hung tier would hold the close as well
        b.close()


def test_a_get_skips_the_tier_its_pages_lookup_did_not_hear_from(tmp_path, sg) -> None:
    """SGLang looks pages up (``batch_exists``), then fetches them (``batch_get_v1``). With a
    file tier hung under a host tier and its breaker still closed, the lookup was cut off at
    ``lookup_timeout_s`` but each page's restore asked the hung tier again and, with no
    deadline, waited for it for ever: SGLang's prefetch thread with it. The restore now skips
    the tiers its page's lookup did not hear from."""
    b, pool, want = _hung_below_host(tmp_path, sg)
    got = None
    try:
        b.file.hang = True
        assert _exists_within(b, KEYS[:2]) == 2  # the host's copies, the file tier cut off
        calls = b.file.calls
        got = _get_within(b, KEYS[:2], DST[:2], pool, sg)
        assert got == [True, True]
        assert b.file.calls == calls  # not asked again
        for page, data in zip(DST[:2], want):
            assert torch.equal(pool.get_data_page(page * pool.page_size), data)
        assert b.engine is not None
        assert b.engine.health.state("file").consecutive_failures == 2  # the two lookups
    finally:
        _close_unless_stuck(b, got)


def test_a_get_whose_tier_hangs_after_its_lookup_is_bounded(tmp_path, sg) -> None:
    """A tier that hangs after the page's lookup heard from it: the restore's probe is cut off
    at the engine's ``probe_share`` of ``get_deadline_s`` (no ``deadline_s`` in the engine
    config), counted against the tier's breaker, and the page comes from the host tier."""
    b, pool, want = _hung_below_host(tmp_path, sg, get_deadline_s=2.0)
    got = None
    try:
        assert _exists_within(b, KEYS[:1]) == 1  # every tier answered
        b.file.hang = True
        got = _get_within(b, KEYS[:1], DST[:1], pool, sg)
        assert got == [True]
        assert torch.equal(pool.get_data_page(DST[0] * pool.page_size), want[0])
        assert b.engine is not None
        assert b.engine.health.state("file").consecutive_failures == 1
    finally:
        _close_unless_stuck(b, got)


def test_a_save_to_a_hung_tier_is_cut_and_ends_its_batch(tmp_path, sg) -> None:
    """A page's save asks each tier what it holds before writing: a tier that hangs held
    ``batch_set_v1`` (SGLang's backup thread) for ever. It is cut at ``save_timeout_s``, the page
    reported not stored, and the batch's later pages are not tried (each would wait as long).
    Once the tier answers again, pages are stored and restored as before."""
    b, pool, _ = _hung_below_host(tmp_path, sg, save_timeout_s=1.0)
    got: list[list[bool]] = []
    try:
        fresh = [sg.fill_page(pool, p, 100 + p) for p in SRC[2:4]]
        b.file.hang = True
        calls = b.file.calls
        t = threading.Thread(
            target=lambda: got.append(b.batch_set_v1(KEYS[2:4], sg.indices(pool, SRC[2:4]))),
            daemon=True,
        )
        t.start()
        t.join(60)  # a hang guard, not a timing claim
        assert got == [[False, False]]
        assert b.file.calls == calls + 1  # the second page was not tried
        b.file.hang = False
        assert b.batch_set_v1(KEYS[2:4], sg.indices(pool, SRC[2:4])) == [True, True]
        assert _exists_within(b, KEYS[2:4]) == 2
        assert b.batch_get_v1(KEYS[2:4], sg.indices(pool, DST[2:4])) == [True, True]
        for page, data in zip(DST[2:4], fresh):
            assert torch.equal(pool.get_data_page(page * pool.page_size), data)
    finally:
        _close_unless_stuck(b, got or None)


@pytest.mark.parametrize("option", ["get_deadline_s", "save_timeout_s"])
def test_the_backends_bounds_are_checked(tmp_path, sg, option: str) -> None:
    config = sg.storage_config(tmp_path)
    for bad in (0, -2.5, "later"):
        config.extra_config["bsr_backend"] = {option: bad}
        with pytest.raises(bsr.ConfigError, match=option):
            BsrHiCacheStorage(config, {})
