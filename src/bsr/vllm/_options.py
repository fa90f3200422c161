"""The connector's settings: its own options, typed and checked, and what it reads from vLLM.

Where it runs: both sides of the connector at startup (vLLM's EngineCore process and every worker
process), so a bad option stops vLLM before it serves anything. Pure parsing, no vLLM import.

How it works: :class:`ConnectorOptions` is the ``kv_connector_extra_config["bsr_connector"]``
dict as a frozen dataclass whose fields are declared like :class:`bsr.EngineConfig`'s (both are
:class:`bsr.Options`), each an ``option(Check....)`` of bsr's option vocabulary, so the same
parsers (and so the same messages) decide them: an unknown key names the closest known one, a
bad value names the key and what to write instead, each a :class:`bsr.ConfigError` with the
dotted ``key``. :func:`settings` reads
the rest from vLLM's config (block size, roles, parallelism, the ``"bsr"`` engine config) into
one :class:`ConnectorSettings` that both sides share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from bsr import Check, ConfigError, EngineConfig, Options, model_config_digest, option

#: Chunk size when the bsr config sets none: the smallest multiple of the block size >= this.
DEFAULT_CHUNK_TOKENS = 256
#: The ``kv_connector_extra_config`` key of the connector options.
SECTION = "bsr_connector"
#: how an option's key reads in a message and in ``ConfigError.fields["key"]``
PREFIX = f"{SECTION}."
LOAD_MODES = ("async", "sync")


@dataclass(frozen=True)
class ConnectorOptions(Options):
    """``kv_connector_extra_config["bsr_connector"]``: how the connector serves (all optional).

    Attributes:
        load: ``"async"`` (default): a load runs across engine steps while other requests keep
            running, and vLLM schedules the request once it is in; ``"sync"``: the step that
            schedules the request waits for its load (every running request waits with it).
        lookup_timeout_s: the most a lookup may take on the worker (a tier still answering
            then is cut off and counts against its breaker); the scheduler never waits for it,
            and gives up on an answer that is this late (plus a grace) as a miss.
        lease_ttl_s: how long a lookup pins what it found for the load that follows.
        load_deadline_s: per-load deadline when the ``"bsr"`` config sets no ``deadline_s``.
        max_pending_saves: saves outstanding at once; more finished requests are not saved.
        save: store finished requests' KV (the role can turn it off too).
        shutdown_timeout_s: how long shutdown waits for saves in flight.
        save_timeout_s: the most one finished request's save may take; a save still running
            then is cut (what it stored so far stays) and reported done, counted in
            ``saves_skipped{reason="timeout"}``, so a stuck store never keeps the request's
            blocks from vLLM's KV pool.
        lookup_connections: connections the worker's lookup socket accepts at once.
        lookup_read_timeout_s: a lookup message must arrive whole within this.
        admit_after_sightings: save only the leading chunks of a finished request that
            requests were seen with at least this many times (1: save every full chunk).
        kv_events_audit_s: with vLLM's KV events on, how often the worker rechecks that every
            object it announced is still in its tier (finds what ``bsr store gc``, another
            server or a remote store's own eviction removed).
        kv_events_max_objects: objects a worker keeps announced (least recently stored first
            out, withdrawn with a BlockRemoved).
        warm_address: ``host:port`` where tensor-parallel rank 0's worker answers
            ``POST /bsr/warm`` (rank ``r`` on the port plus ``r``); None (default): no endpoint.
            Bind it to loopback or a private network: anyone who reaches it can make the
            instance read from its store (within the engine's warm bounds).
        warm_timeout_s: a warm's deadline when its request gives none.

    Every ``*_s`` option is a number of seconds > 0 and at most 2,147,483 s (about 24.8 days:
    the longest timeout a socket or ``poll()`` takes); a larger one, infinity or NaN is refused
    here, at startup, naming its key.
    """

    options_prefix = PREFIX
    options_name = f"kv_connector_extra_config[{SECTION!r}]"

    load: str = option(Check.one_of(*LOAD_MODES), "async")
    lookup_timeout_s: float = option(Check.seconds, 2.0)
    lease_ttl_s: float = option(Check.seconds, 30.0)
    load_deadline_s: float = option(Check.seconds, 10.0)
    max_pending_saves: int = option(Check.positive_int, 64)
    save: bool = option(Check.flag, True)
    shutdown_timeout_s: float = option(Check.seconds, 30.0)
    save_timeout_s: float = option(Check.seconds, 10.0)
    lookup_connections: int = option(Check.positive_int, 4)
    lookup_read_timeout_s: float = option(Check.seconds, 5.0)
    admit_after_sightings: int = option(Check.positive_int, 1)
    kv_events_audit_s: float = option(Check.seconds, 10.0)
    kv_events_max_objects: int = option(Check.positive_int, 1 << 16)
    warm_address: str | None = option(Check.optional_address, None)
    warm_timeout_s: float = option(Check.seconds, 10.0)

    @property
    def asynchronous(self) -> bool:
        return self.load == "async"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, prefix: str | None = None) -> Self:
        """Parse the ``"bsr_connector"`` dict (``None``: every default).

        Raises:
            ConfigError: not a dict, an unknown key (with the closest known one), or a bad
                value (naming the key, e.g. ``bsr_connector.lookup_timeout_s``).
        """
        return cls() if data is None else super().from_dict(data, prefix)


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything both sides of the connector need, read once from vLLM's config.

    Attributes:
        engine: the ``"bsr"`` engine config.
        options: the connector options.
        block_size: vLLM's block size (tokens).
        chunk_tokens: bsr's chunk size, a multiple of ``block_size``.
        tp_size: tensor-parallel ranks.
        model_id: the namespace's model id.
        config_digest: :func:`bsr.model_config_digest` of vLLM's model config (``hf_config``),
            bound into the namespace.
        engine_id: vLLM's ``engine_id`` (logs only: the lookup socket path is private).
        loads: this role loads (``kv_both``, ``kv_consumer``).
        saves: this role saves (``kv_both``, ``kv_producer``) and ``options.save`` is on.
        failure_policy: vLLM's ``kv_load_failure_policy``.
        kv_events: vLLM publishes KV cache events (``--kv-events-config`` with
            ``enable_kv_cache_events``): the connector announces what bsr stores and removes.
        group_windows: per vLLM KV cache group, the trailing tokens bsr keeps of a sliding
            window group (:func:`bsr.vllm._layout.group_window`), ``None`` for a full one.
    """

    engine: EngineConfig
    options: ConnectorOptions
    block_size: int
    chunk_tokens: int
    tp_size: int
    model_id: str
    config_digest: str
    engine_id: str
    loads: bool
    saves: bool
    failure_policy: str
    kv_events: bool = False
    group_windows: tuple[int | None, ...] = (None,)


def settings(vllm_config: Any, kv_cache_config: Any) -> ConnectorSettings:
    """Read and check the connector's settings from vLLM's config (both roles, at startup).

    Raises:
        ConfigError: no ``"bsr"`` dict, a bad engine config or connector option, a chunk size
            that is not a multiple of the block size, or a parallelism the connector refuses.
    """
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    if "bsr" not in extra:
        raise ConfigError(
            "BsrConnector needs kv_connector_extra_config={'bsr': {...}}, e.g. "
            "{'bsr': {'tiers': [{'kind': 'file', 'path': '/nvme/bsr', "
            "'capacity_bytes': '100GiB'}]}}",
            key="bsr",
        )
    engine = EngineConfig.from_dict(extra["bsr"])
    options = ConnectorOptions.from_dict(extra.get(SECTION))
    block_size = Check.positive_int(int(vllm_config.cache_config.block_size), "block_size")
    check_groups(kv_cache_config, options, block_size)
    role = str(ktc.kv_role)
    return ConnectorSettings(
        engine=engine,
        options=options,
        block_size=block_size,
        chunk_tokens=chunk_tokens(engine.chunk_tokens, block_size),
        tp_size=check_parallelism(vllm_config, kv_cache_config),
        model_id=engine.model_id or default_model_id(vllm_config),
        config_digest=model_config_digest(vllm_config.model_config.hf_config),
        engine_id=str(ktc.engine_id),
        loads=role != "kv_producer",
        saves=role != "kv_consumer" and options.save,
        failure_policy=str(ktc.kv_load_failure_policy),
        kv_events=bool(
            getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False)
        ),
        group_windows=group_windows(kv_cache_config),
    )


def group_windows(kv_cache_config: Any) -> tuple[int | None, ...]:
    """Each KV cache group's window as bsr stores it (``None``: full attention)."""
    from ._layout import group_window  # torch; the parsing above needs none

    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if not groups:
        return (None,)
    return tuple(group_window(g.kv_cache_spec) for g in groups)


def default_model_id(vllm_config: Any) -> str:
    mc = vllm_config.model_config
    return f"{mc.model}@{mc.revision or ''}:{mc.dtype}:{vllm_config.cache_config.cache_dtype}"


def chunk_tokens(configured: int | None, block_size: int) -> int:
    """bsr's chunk size: the configured one (a multiple of vLLM's block size) or the default
    rounded up to whole blocks."""
    chunk = configured
    if chunk is None:
        chunk = -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
    if chunk % block_size:
        raise ConfigError(
            f"chunk_tokens={chunk} is not a multiple of vLLM's block_size="
            f"{block_size}; use a multiple of {block_size}",
            key="chunk_tokens",
        )
    return int(chunk)


def check_parallelism(vllm_config: Any, kv_cache_config: Any) -> int:
    """Refuse what the connector does not support; return the tensor-parallel size."""
    pc = vllm_config.parallel_config
    pp = int(pc.pipeline_parallel_size)
    dp = int(getattr(pc, "data_parallel_size", 1) or 1)
    if pp != 1 or dp != 1:
        raise ConfigError(
            "BsrConnector supports tensor parallelism only (pipeline_parallel_size=1, "
            f"data_parallel_size=1), got pp={pp}, dp={dp}"
        )
    return Check.non_negative_int(int(pc.tensor_parallel_size), "tensor_parallel_size") or 1


def check_groups(kv_cache_config: Any, options: ConnectorOptions, block_size: int) -> None:
    """Refuse KV cache groups the connector cannot serve (several groups are fine).

    With several groups (vLLM's hybrid KV cache manager: sliding-window and full-attention
    layers apart) vLLM accepts a failed load only as a failed request (``failed_recving``,
    asynchronous loads); a synchronous load can report only blocks, which vLLM refuses for
    several groups (its engine stops), so ``load="sync"`` is refused here. Every group must
    use vLLM's one block size (bsr's block tables share one block geometry).
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if len(groups) > 1 and not options.asynchronous:
        raise ConfigError(
            f"bsr_connector.load='sync' cannot report a failed load to vLLM for a model with "
            f"{len(groups)} KV cache groups (vLLM accepts only a failed request then, which "
            "needs asynchronous loads); use load='async' (the default), or turn vLLM's hybrid "
            "KV cache manager off (--disable-hybrid-kv-cache-manager)",
            key=f"{SECTION}.load",
        )
    for g in groups:
        size = getattr(getattr(g, "kv_cache_spec", None), "block_size", block_size)
        if int(size) != block_size:
            raise ConfigError(
                f"KV cache group of layers {list(getattr(g, 'layer_names', []))[:2]}... uses "
                f"block_size={size}, vLLM's block_size is {block_size}; BsrConnector needs one "
                "block size for every group",
                key="block_size",
            )
