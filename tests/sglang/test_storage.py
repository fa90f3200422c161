"""bsr.sglang against SGLang's real storage interface (sglang 0.5.23, no CUDA stack).

Runs in .venv-sglang (make test's "SGLang tests" phase); skipped where SGLang is not installed.
Real files on disk, a real bsr engine; the host pool is conftest's copy of SGLang's pools.
"""

from __future__ import annotations

import inspect

import pytest
import torch

hicache = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import bsr  # noqa: E402
from bsr.sglang import BsrHiCacheStorage, host_pages  # noqa: E402


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


def test_every_abstract_and_v1_v2_method_is_implemented():
    base = hicache.HiCacheStorage
    assert not BsrHiCacheStorage.__abstractmethods__
    assert issubclass(BsrHiCacheStorage, base)
    names = ("batch_get_v1", "batch_set_v1", "batch_exists", "batch_exists_v2", "batch_get_v2",
             "batch_set_v2", "get_stats", "clear", "register_mem_pool_host")  # fmt: skip
    for name in names:
        ours = getattr(BsrHiCacheStorage, name)
        assert ours is not getattr(base, name), name
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(getattr(base, name)).parameters
        ), name


def test_return_types_never_none(tmp_path, sg, backends):
    pool = sg.mha_pool()
    b = backends(sg.storage_config(tmp_path), pool)
    for p in range(3):
        sg.fill_page(pool, p, p)
    assert b.batch_set_v1(["a", "b", "c"], sg.indices(pool, [0, 1, 2])) == [True] * 3
    assert b.batch_exists(["a", "b", "x", "c"]) == 2
    assert type(b.batch_exists(["x"])) is int
    got = b.batch_get_v1(["a", "x", "c"], sg.indices(pool, [5, 6, 7]))
    assert got == [True, False, False]
    assert b.exists("c") is True and b.exists("x") is False
    page = pool.get_dummy_flat_data_page()
    assert b.get("b", page) is page and b.get("x", pool.get_dummy_flat_data_page()) is None
    assert b.set("d", pool.get_data_page(0)) is True
    assert b.batch_set(["e"], [pool.get_data_page(4)]) is True
    assert b.batch_get(["d", "x", "e"], [pool.get_dummy_flat_data_page()] * 3)[1:] == [None] * 2
    res = b.batch_exists_v2(["a", "b", "x"])
    assert isinstance(res, hicache.PoolTransferResult)
    assert (res.kv_hit_pages, res.restorable_prefix_pages) == (2, [1, 2])
    kv = hicache.PoolTransfer(name=hicache.PoolName.KV, host_indices=sg.indices(pool, [9]),
                              keys=["a"])  # fmt: skip
    assert b.batch_get_v2([kv]) == {"kv": [True]}
    assert b.batch_set_v2([kv]) == {"kv": [True]}
    stats = b.get_stats()
    assert stats.prefetch_pgs and stats.backup_pgs and stats.bsr is not None
    assert stats.bsr.saves >= 5 and b.clear() is False


@pytest.mark.parametrize("name", ["swa", "mamba"])
def test_v2_refuses_other_pools_with_a_message(tmp_path, sg, backends, name):
    pool = sg.mha_pool()
    b = backends(sg.storage_config(tmp_path), pool)
    other = hicache.PoolTransfer(name=hicache.PoolName(name), host_indices=sg.indices(pool, [0]),
                                 keys=["a"])  # fmt: skip
    for call in (lambda: b.batch_exists_v2(["a"], [other]), lambda: b.batch_get_v2([other]),
                 lambda: b.batch_set_v2([other])):  # fmt: skip
        with pytest.raises(NotImplementedError, match=f"'{name}'.*only 'kv'"):
            call()


def test_sglangs_dynamic_loader_builds_it_from_the_documented_line(tmp_path, sg):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = sg.storage_config(tmp_path)
    config.extra_config = sg.documented_extra_config(tmp_path)
    pool = sg.mha_pool()
    b = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert type(b) is BsrHiCacheStorage and config.extra_config["interface_v1"] == 1
    b.register_mem_pool_host(pool)
    try:
        assert b.engine is not None and b.engine.window == config.extra_config["bsr"]["window"]
        want = sg.fill_page(pool, 0, 7)
        assert b.batch_set_v1(["k"], sg.indices(pool, [0])) == [True]
        assert b.batch_get_v1(["k"], sg.indices(pool, [3])) == [True]
        assert torch.equal(pool.get_data_page(3 * pool.page_size), want)
    finally:
        b.close()


def test_config_errors_name_what_to_change(tmp_path, sg):
    config = sg.storage_config(tmp_path)
    config.extra_config = {}
    with pytest.raises(bsr.ConfigError, match="'bsr' object"):
        BsrHiCacheStorage(config, {})
    config = sg.storage_config(tmp_path)
    config.extra_config["bsr"]["window"] = 0
    with pytest.raises(bsr.ConfigError, match="window"):
        BsrHiCacheStorage(config, {})
    pool = sg.mha_pool()
    pool.layout = "page_unified"
    with pytest.raises(bsr.LayoutError, match="page_unified"):
        BsrHiCacheStorage(sg.storage_config(tmp_path), {}).register_mem_pool_host(pool)
    for bad, says in (
        ({"lookup_timeout_s": -1}, "bsr_backend.lookup_timeout_s"),
        ({"lookup_timeout": 1.0}, "lookup_timeout_s"),  # the closest known key
        ("fast", "bsr_backend"),
    ):
        config = sg.storage_config(tmp_path)
        config.extra_config["bsr_backend"] = bad
        with pytest.raises(bsr.ConfigError, match=says):
            BsrHiCacheStorage(config, {})


def test_host_indices_must_cover_whole_pages(tmp_path, sg, backends):
    pool = sg.mha_pool()
    b = backends(sg.storage_config(tmp_path), pool)
    with pytest.raises(bsr.ConfigError, match="page_size indices per key"):
        b.batch_set_v1(["a", "b"], sg.indices(pool, [0]))
    with pytest.raises(bsr.ConfigError, match="do not start pages"):
        b.batch_set_v1(["a"], sg.indices(pool, [0]) + 1)


LAYOUTS = [("mha", x) for x in ("layer_first", "page_first", "page_first_direct", "page_head")]
LAYOUTS += [("mla", x) for x in ("layer_first", "page_first", "page_first_direct")]


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS)
def test_page_views_are_the_pools_flat_pages(tmp_path, sg, backends, kind, layout):
    pool = (sg.mha_pool if kind == "mha" else sg.mla_pool)(layout)
    pages = host_pages(pool, is_mla=kind == "mla")
    for p in range(pool.page_num):
        sg.fill_page(pool, p, 100 + p)
    blocks = pages.cache
    for p in (0, 5, pool.page_num - 1):  # the views' bytes of page p, in order, are its flat page
        views = blocks._layers["kv"]
        got = torch.cat([v[p].reshape(-1) for v in views])
        assert torch.equal(got, pool.get_data_page(p * pool.page_size).view(torch.uint8))
    b = backends(sg.storage_config(tmp_path, mla=kind == "mla"), pool)
    want = [pool.get_data_page(p * pool.page_size).clone() for p in range(4)]
    assert b.batch_set_v1(list("abcd"), sg.indices(pool, range(4))) == [True] * 4
    pool.kv_buffer.zero_()
    assert b.batch_get_v1(list("abcd"), sg.indices(pool, [9, 3, 12, 1])) == [True] * 4
    for page, w in zip([9, 3, 12, 1], want):
        assert torch.equal(pool.get_data_page(page * pool.page_size), w)
