"""The rates HCache's planner needs, measured on the machine that restores.

Where it runs: the serving process (or the bench), once per model, device and tier; the planner
then runs per restore from the cached :class:`~bsr.hcache.Rates`.

How it works: :func:`measure_compute` times the real paged rebuild of every layer
(:func:`~bsr.hcache.rebuild_rows`) and a prefill on the model's device; :func:`measure_read`
saves a scratch state on the tier and restores it through a :class:`~bsr.RestoreEngine` into a
paged cache on that same device, so the rate is the tier's read, verification, host staging and
host-to-device copy together, as a restore pays them. :func:`calibrate` keeps the result in the
process and, with ``cache_dir``, in a JSON file named by what the rates depend on (model config
and dtype, device, torch threads, tier, measurement sizes, torch and bsr versions), so a server
measures once per machine and reuses the rates across restarts; ``refresh=True`` measures again
and rewrites the file. A file that cannot be read or holds invalid rates is measured over.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from .. import StateGroup, StateLayout
from .._errors import ConfigError
from .._log import logger
from .._model_config import text_config
from ._arch import dtype_name
from ._plan import KV, Rates

__all__ = ("calibrate", "calibration_key", "measure_compute", "measure_read")

_log = logger.bind(component="hcache")
#: per model object (weakly: a new model never inherits a collected one's rates), per setting
_RATES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Rates]] = weakref.WeakKeyDictionary()
#: the version of the calibration file's format (a change makes older files a miss)
FORMAT = 1


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # pragma: no cover - no GPU in CI
        torch.cuda.synchronize(device)


def measure_compute(model: Any, *, tokens: int = 512, repeats: int = 3) -> tuple[float, float]:
    """(project, recompute) seconds per token and layer of ``model`` on its device.

    Projection: :func:`~bsr.hcache.rebuild_rows` of every layer from random hidden states
    (blocks in shuffled order, as a restore lands them) into a scratch paged cache. Recompute:
    one prefill of ``tokens`` random tokens.
    """
    from .. import PagedKVCache
    from ._arch import ModelAdapter
    from ._state import rebuild_rows

    a = ModelAdapter(model)
    s = a.shape
    bt = 16
    tokens = max(bt, tokens // bt * bt)
    nb = tokens // bt
    name = dtype_name(a.dtype)
    item = a.dtype.itemsize
    hl = StateLayout(tokens, (StateGroup("h", s.num_layers, s.hidden * item, dtype=name),))
    kl = StateLayout(tokens, (StateGroup(KV, s.num_layers, 2 * s.kv_dim * item, dtype=name),))
    src = PagedKVCache(hl, nb, bt, device=a.device)
    src.typed("h").normal_()
    dst = PagedKVCache(kl, nb, bt, device=a.device)
    ids = torch.randperm(nb, generator=torch.Generator().manual_seed(0))
    proj: list[float] = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        rope = a.rope(0, tokens)
        rebuild_rows(a, src, "h", range(s.num_layers), dst, ids, tokens, rope)
        _sync(a.device)
        proj.append(time.perf_counter() - t0)
    vocab = int(getattr(text_config(model.config), "vocab_size", 32) or 32)
    ids_in = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    rec: list[float] = []
    with torch.no_grad():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            model(input_ids=ids_in.to(a.device), use_cache=True)
            _sync(a.device)
            rec.append(time.perf_counter() - t0)
    per = tokens * s.num_layers
    return _median(proj[1:]) / per, _median(rec[1:]) / per


def measure_read(
    tier_factory: Any = None,
    *,
    mib: int = 64,
    window: int = 4,
    repeats: int = 5,
    device: str | torch.device = "cpu",
) -> float:
    """Restore bandwidth (bytes/s) of a tier through a :class:`~bsr.RestoreEngine`.

    Saves ``mib`` MiB of a scratch KV layout and restores it ``repeats`` times into a paged
    cache on ``device`` (the same path, verification, staging and install as a real restore:
    on a GPU the host-to-device copy is part of the rate); returns the median.

    Args:
        tier_factory: ``callable(path) -> Tier``; default a :class:`~bsr.FileTier` in a
            temporary directory.
        device: where the restored cache lives (the model's device).
    """
    import anyio

    from .. import FileTier, Namespace, PagedKVCache, RestoreEngine

    chunk, bt, row = 256, 16, 16384
    n_chunks = max(1, (mib << 20) // (chunk * row))
    layout = StateLayout(chunk, (StateGroup(KV, 1, row),))
    n = n_chunks * chunk
    src = PagedKVCache(layout, n // bt, bt)
    src.tensor(KV).random_(0, 255)
    cache = PagedKVCache(layout, n // bt, bt, device=device)
    ids = torch.arange(n // bt)
    tokens = torch.arange(n)
    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="bsr-calib-") as tmp:
        tier = tier_factory(tmp) if tier_factory else FileTier(tmp, capacity_bytes=(mib + 16) << 20)

        async def run() -> list[float]:
            engine = RestoreEngine(
                layout,
                [tier],
                window=window,
                io_depth=min(window, 4),
                namespace=Namespace("bsr-calibrate"),
            )
            out = []
            async with engine:
                await engine.save(tokens, src, ids)
                await engine.restore(tokens, cache, ids)  # warm-up: first-touch, thread pools
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    res = await engine.restore(tokens, cache, ids)
                    _sync(dev)
                    out.append(time.perf_counter() - t0)
                    if res.committed_tokens != n:
                        raise ConfigError("calibration restore did not commit; check the tier")
            return out

        times = anyio.run(run)
    return n * row / _median(times)


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":  # pragma: no cover - no GPU in CI
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"{dev.type}:{platform.processor() or platform.machine()}:{os.cpu_count()} cpus"


def calibration_key(
    model: Any, *, tier_name: str = "file", tokens: int = 512, read_mib: int = 64
) -> dict[str, Any]:
    """What a model's calibrated rates depend on (the name of its calibration file)."""
    from .. import __version__, model_config_digest
    from ._arch import ModelAdapter

    a = ModelAdapter(model)
    return {
        "format": FORMAT,
        "model_config": model_config_digest(model.config),
        "dtype": dtype_name(a.dtype),
        "device": _device_name(a.device),
        "torch_threads": torch.get_num_threads(),
        "tier": tier_name,
        "tokens": tokens,
        "read_mib": read_mib,
        "torch": torch.__version__,
        "bsr": __version__,
    }


def _file(cache_dir: str | os.PathLike[str], key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"hcache-rates-{digest}.json"


def _load(path: Path, key: dict[str, Any]) -> Rates | None:
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") != key:
            return None
        return Rates(**doc["rates"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, ConfigError) as exc:
        _log.warning("hcache_calibration_unreadable", path=str(path), error=repr(exc))
        return None


def _store(path: Path, key: dict[str, Any], rates: Rates) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "key": key,
        "rates": {
            "read_bytes_per_s": rates.read_bytes_per_s,
            "project_s_per_token_layer": rates.project_s_per_token_layer,
            "recompute_s_per_token_layer": rates.recompute_s_per_token_layer,
            "calibrated_tokens": rates.calibrated_tokens,
            "source": rates.source,
            "shared": rates.shared,
        },
        "measured_at": time.time(),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True))
    os.replace(tmp, path)


def calibrate(
    model: Any,
    *,
    tier_factory: Any = None,
    tier_name: str = "file",
    tokens: int = 512,
    refresh: bool = False,
    read_bytes_per_s: float | None = None,
    read_mib: int = 64,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Rates:
    """Measure (once; cached per model, device and tier name) the rates :func:`plan_layers` needs.

    Args:
        model: the model (its device is where projections, recompute and the read's installs
            run).
        tier_factory: ``callable(path) -> Tier`` for the read measurement (default FileTier).
        tier_name: the cache key for the tier (calibrate each storage tier under its own name).
        tokens: prefix length of the compute measurements.
        refresh: measure again (and rewrite the file in ``cache_dir``).
        read_bytes_per_s: skip the read measurement and use this bandwidth.
        read_mib: MiB saved and restored by the read measurement.
        cache_dir: keep the rates in a file there (see :func:`calibration_key`) and reuse them
            in later processes on the same machine; ``None``: in this process only. Not used
            with ``read_bytes_per_s`` (rates partly given are not the machine's to keep).
    """
    from ._arch import ModelAdapter

    dev = ModelAdapter(model).device
    key = (str(dev), tier_name, tokens, read_bytes_per_s, read_mib)
    known = _RATES.setdefault(model, {})
    if not refresh and key in known:
        return known[key]
    path = None
    if cache_dir is not None and read_bytes_per_s is None:
        file_key = calibration_key(model, tier_name=tier_name, tokens=tokens, read_mib=read_mib)
        path = _file(cache_dir, file_key)
        stored = None if refresh else _load(path, file_key)
        if stored is not None:
            known[key] = stored
            return stored
    proj, rec = measure_compute(model, tokens=tokens)
    read = (
        read_bytes_per_s
        if read_bytes_per_s is not None
        else measure_read(tier_factory, mib=read_mib, device=dev)
    )
    rates = Rates(read, proj, rec, tokens, "measured", shared=dev.type == "cpu")
    known[key] = rates
    if path is not None:
        _store(path, file_key, rates)
    return rates
