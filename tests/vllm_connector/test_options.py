"""The connector's options are checked at startup like EngineConfig's (no vLLM needed).

Found as a hostile user: ``lookup_timeout_s=-1`` was accepted at startup and killed vLLM's
engine core on the first request.
"""

from __future__ import annotations

from typing import Any

import pytest

import bsr
from bsr.vllm._options import ConnectorOptions, check_groups, chunk_tokens


def test_defaults_are_async_and_valid() -> None:
    opts = ConnectorOptions.from_dict(None)
    assert opts == ConnectorOptions.from_dict({})
    assert opts.load == "async" and opts.asynchronous
    assert not ConnectorOptions.from_dict({"load": "sync"}).asynchronous


@pytest.mark.parametrize(
    ("given", "key", "says"),
    [
        ({"lookup_timeout_s": -1}, "bsr_connector.lookup_timeout_s", "> 0"),
        ({"lookup_timeout_s": 0}, "bsr_connector.lookup_timeout_s", "> 0"),
        ({"lookup_timeout_s": float("nan")}, "bsr_connector.lookup_timeout_s", "finite"),
        ({"lookup_timeout_s": "2"}, "bsr_connector.lookup_timeout_s", "int or float"),
        ({"lease_ttl_s": True}, "bsr_connector.lease_ttl_s", "int or float"),
        ({"load_deadline_s": float("inf")}, "bsr_connector.load_deadline_s", "finite"),
        ({"max_pending_saves": 0}, "bsr_connector.max_pending_saves", "positive int"),
        ({"max_pending_saves": 2.5}, "bsr_connector.max_pending_saves", "positive int"),
        ({"lookup_connections": -3}, "bsr_connector.lookup_connections", "positive int"),
        ({"save": "yes"}, "bsr_connector.save", "true or false"),
        ({"load": "lazy"}, "bsr_connector.load", "one of ['async', 'sync']"),
        ({"lookup_timeout": 2}, "bsr_connector.lookup_timeout", "did you mean 'lookup_timeout_s'"),
    ],
)
def test_a_bad_option_names_its_key_and_what_to_write(
    given: dict[str, Any], key: str, says: str
) -> None:
    with pytest.raises(bsr.ConfigError) as info:
        ConnectorOptions.from_dict(given)
    assert info.value.fields["key"] == key
    assert key in str(info.value) and says in str(info.value)


def test_not_a_dict_is_refused() -> None:
    with pytest.raises(bsr.ConfigError, match="must be a dict"):
        ConnectorOptions.from_dict([("load", "sync")])


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(bsr.ConfigError, match="lookup_timeout_s"):
        ConnectorOptions(lookup_timeout_s=-1)
    assert ConnectorOptions(lookup_timeout_s=3).lookup_timeout_s == 3.0


def test_chunk_tokens_follow_the_block_size() -> None:
    assert chunk_tokens(None, 32) == 256
    assert chunk_tokens(None, 48) == 288  # the smallest multiple of 48 >= 256
    assert chunk_tokens(64, 32) == 64
    with pytest.raises(bsr.ConfigError, match="multiple of vLLM's block_size=32"):
        chunk_tokens(48, 32)


def _groups(*specs: Any) -> Any:
    """vLLM's own KVCacheConfig with one group per spec."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    groups = [kvi.KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    return kvi.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_several_kv_cache_groups_need_async_loads_and_one_block_size() -> None:
    """vLLM refuses block-level load failures with several KV cache groups (a sync load error
    stopped its engine): sync loads are refused at startup, naming the key; async is fine."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    import torch

    common = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    full = kvi.FullAttentionSpec(block_size=32, **common)
    swa = kvi.SlidingWindowSpec(block_size=32, sliding_window=64, **common)
    sync, default = ConnectorOptions.from_dict({"load": "sync"}), ConnectorOptions.from_dict({})
    check_groups(_groups(swa, full), default, 32)
    check_groups(_groups(full), sync, 32)
    with pytest.raises(bsr.ConfigError) as info:
        check_groups(_groups(swa, full), sync, 32)
    assert info.value.fields["key"] == "bsr_connector.load" and "load='async'" in str(info.value)
    other = kvi.SlidingWindowSpec(block_size=16, sliding_window=64, **common)
    with pytest.raises(bsr.ConfigError, match="block_size=16") as info:
        check_groups(_groups(other, full), default, 32)
    assert info.value.fields["key"] == "block_size"
