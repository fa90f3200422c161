"""LoRA adapters as vLLM's worker loaded them: what a LoRA request's KV is keyed by.

Where it runs: :func:`adapter_marker` on the connector's scheduler side (vLLM's EngineCore
process, inside the scheduler's loop: it makes no file system call); :class:`AdapterBook` in
every worker process, fed by hooks on vLLM's LoRA model manager (vLLM's execute-model thread,
where vLLM loads adapters) and read by the connector's lookups, loads and saves (its event-loop
thread and vLLM's thread).

How it works: the KV a LoRA request computes depends on the adapter weights the worker holds,
not on the files its path names now (a file rewritten under a running server is not what vLLM
computes with: vLLM keeps the weights it loaded), and a stat or read of the files on vLLM's
scheduler loop would stall every running request behind a slow mount. So:

* The scheduler keys a LoRA request with a *marker*, ``vllm-lora-ref:<lora_int_id>``: vLLM's
  worker identifies a loaded adapter by that id. A marker is never stored: a worker replaces it
  before anything is looked up, loaded or saved.
* Each worker process digests the weights vLLM registers in its LoRA model manager
  (``LoRAModelManager._add_adapter``, after vLLM packed them: every tensor's dtype, shape and
  bytes, each module's rank, alpha and scaling, sorted by module; :func:`weights_digest`) once
  per load or reload, and forgets an adapter vLLM evicts or removes
  (``AdapterLRUCache._on_remove``). The hooks are installed once per process
  (:func:`adapter_book`); each tensor-parallel rank digests what it loaded.
* A lookup or a load replaces the marker by ``vllm-lora:<digest>`` of the weights loaded now;
  an adapter the worker has not loaded (or could not digest) is a miss, never a wait and never
  a file read.
* A save uses the digest of the weights that computed the request: the worker *binds* the
  request when it first sees it (its load, or the step that first schedules it, whose adapter
  vLLM loads before the connector's hooks run) and records every load of that adapter after;
  if the request's life saw weights with two digests (a reload with other weights in place,
  ``load_inplace``, or an eviction and a reload of rewritten files), the save is skipped.

Residual race: a load resolves the digest of the weights loaded when it starts. If vLLM evicts
the adapter and reloads other weights under the same id between that load and the request's
first forward, the request computes on KV of the old weights (its own output, as vLLM's prefix
cache would serve it in the same case); bsr never saves that request (the binding saw two
digests), so the mix is never served to another request.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import weakref
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bsr import KeyExtra

from .._log import logger

#: the scheduler's marker of a LoRA request: the worker replaces it by the weights' digest
MARKER_PREFIX = b"vllm-lora-ref:"
#: a bound adapter's key: the digest of the weights as the worker loaded them
DIGEST_PREFIX = b"vllm-lora:"
#: stands for an adapter that cannot be bound (never matches anything stored)
UNBOUND_PREFIX = b"vllm-lora-unbound:"
#: adapter loads a book remembers (older bindings are no longer known: their saves skip)
HISTORY = 1024
#: nesting a digest walks into (a LoRAModel is three levels deep)
MAX_DEPTH = 8
#: why a save of a LoRA request was skipped (``saves_skipped`` labels)
ADAPTER_UNBOUND = "adapter_unbound"
ADAPTER_CHANGED = "adapter_changed"


def adapter_marker(lora: Any) -> KeyExtra:
    """The scheduler's extra for a request's LoRA adapter (``lora_request``): its vLLM id only,
    no file system call (the worker binds it to the weights it loaded)."""
    return KeyExtra(MARKER_PREFIX + b"%d" % int(lora.lora_int_id))


def marker_id(extra: KeyExtra) -> int | None:
    """The adapter id of a marker extra (None: not a marker)."""
    if not extra.key.startswith(MARKER_PREFIX):
        return None
    return int(extra.key[len(MARKER_PREFIX) :])


def has_marker(extras: tuple[KeyExtra, ...]) -> bool:
    return any(e.key.startswith(MARKER_PREFIX) for e in extras)


class DigestError(Exception):
    """The loaded adapter holds something :func:`weights_digest` cannot digest."""


def weights_digest(model: Any) -> bytes:
    """SHA-256 of a vLLM ``LoRAModel`` as registered: every attribute but its per-server id,
    tensors by dtype, shape and bytes (on the CPU, where vLLM keeps registered adapters).

    Raises:
        DigestError: a value it cannot digest (a sparse or quantized tensor, an unknown type).
    """
    h = hashlib.sha256(b"bsr-vllm-lora-weights/1\0")
    _feed(h, {k: v for k, v in vars(model).items() if k != "id"}, 0)
    return h.digest()


def _feed(h: Any, value: Any, depth: int) -> None:
    import torch

    if depth > MAX_DEPTH:
        raise DigestError("an adapter nested deeper than a LoRAModel")
    if value is None:
        h.update(b"N")
    elif isinstance(value, bool):
        h.update(b"B1" if value else b"B0")
    elif isinstance(value, int):
        h.update(b"I%d;" % value)
    elif isinstance(value, float):
        h.update(b"F" + struct.pack("<d", value))
    elif isinstance(value, str):
        raw = value.encode("utf-8", "surrogatepass")
        h.update(b"S%d:" % len(raw) + raw)
    elif isinstance(value, torch.Tensor):
        t = value.detach()
        if t.layout != torch.strided or t.is_quantized:
            raise DigestError(f"a {t.layout} tensor")
        t = t.to("cpu").contiguous()
        h.update(f"T{t.dtype}:{tuple(t.shape)}:".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d:" % len(value))
        for v in value:
            _feed(h, v, depth + 1)
    elif isinstance(value, Mapping):
        h.update(b"D%d:" % len(value))
        for k in sorted(value, key=str):
            _feed(h, str(k), depth + 1)
            _feed(h, value[k], depth + 1)
    elif hasattr(value, "__dict__"):
        h.update(b"O" + type(value).__qualname__.encode() + b":")
        _feed(h, dict(vars(value)), depth + 1)
    else:
        raise DigestError(f"a value of type {type(value).__name__}")


@dataclass(frozen=True)
class Binding:
    """What a request's adapter was when the worker first saw the request.

    Attributes:
        lora_id: vLLM's adapter id.
        since: the book's generation then (loads after it are later ones).
        digest: the weights loaded then (None: not loaded, or not digestible).
    """

    lora_id: int
    since: int
    digest: bytes | None


@dataclass
class _Loaded:
    model: Any  # a weak reference to vLLM's LoRAModel (or the model itself)
    digest: bytes | None


class AdapterBook:
    """One worker process's adapters as vLLM loaded them (see the module docstring).

    Thread-safe: vLLM's thread reports loads and removals, the connector's loop thread asks.
    """

    def __init__(self, history: int = HISTORY) -> None:
        self._lock = threading.Lock()
        self._gen = 0
        self._loaded: dict[int, _Loaded] = {}  # lora id -> what vLLM holds registered now
        self._history: deque[tuple[int, int, bytes | None]] = deque()  # (gen, id, digest)
        self._max_history = history
        self._forgot = 0  # loads up to this generation fell out of the history
        self._binds: dict[str, Binding] = {}
        self.hooked = False  # the vLLM hooks are in place (else every adapter is unbound)
        self._log = logger.bind(role="worker")

    # ------------------------------------------------------------------ vLLM's side
    def loaded(self, model: Any) -> None:
        """vLLM registered ``model`` (a ``LoRAModel``) under its id: digest its weights."""
        try:
            lora_id = int(model.id)
        except (AttributeError, TypeError, ValueError):
            return
        try:
            digest: bytes | None = weights_digest(model)
        except Exception as exc:  # an adapter bsr cannot digest: misses, never saved
            digest = None
            self._log.warning("bsr.vllm.adapter_undigestable", lora_id=lora_id, error=repr(exc))
        try:
            ref: Any = weakref.ref(model)
        except TypeError:
            ref = model
        with self._lock:
            self._gen += 1
            self._loaded[lora_id] = _Loaded(ref, digest)
            self._history.append((self._gen, lora_id, digest))
            while len(self._history) > self._max_history:
                self._forgot = self._history.popleft()[0]
        self._log.info(
            "bsr.vllm.adapter_loaded", lora_id=lora_id,
            digest=None if digest is None else digest.hex()[:16],
        )  # fmt: skip

    def removed(self, lora_id: Any, model: Any) -> None:
        """vLLM dropped ``model`` from its registered adapters (evicted or removed)."""
        if model is None:  # vLLM's cache of adapters in GPU slots: the weights stay registered
            return
        with self._lock:
            entry = self._loaded.get(lora_id) if isinstance(lora_id, int) else None
            if entry is not None and _target(entry.model) is model:
                del self._loaded[lora_id]

    # ------------------------------------------------------------------ the connector's side
    def current(self, lora_id: int) -> bytes | None:
        """The digest of the weights registered under ``lora_id`` now (None: none, or not
        digestible)."""
        with self._lock:
            entry = self._loaded.get(lora_id)
            return None if entry is None else entry.digest

    def resolve(self, extras: tuple[KeyExtra, ...]) -> tuple[KeyExtra, ...] | None:
        """``extras`` with each marker replaced by the weights loaded now (lookups); None when
        an adapter is not loaded here."""
        if not has_marker(extras):
            return extras
        out = []
        for e in extras:
            lora_id = marker_id(e)
            if lora_id is None:
                out.append(e)
                continue
            digest = self.current(lora_id)
            if digest is None:
                return None
            out.append(KeyExtra(DIGEST_PREFIX + digest, e.start, e.end))
        return KeyExtra.canonical(out)

    def bind(self, req_id: str, lora_id: int) -> Binding:
        """Bind ``req_id`` to ``lora_id`` as loaded now, unless it is bound already."""
        with self._lock:
            b = self._binds.get(req_id)
            if b is None:
                entry = self._loaded.get(lora_id)
                b = Binding(lora_id, self._gen, None if entry is None else entry.digest)
                self._binds[req_id] = b
            return b

    def bind_and_resolve(
        self, req_id: str, extras: tuple[KeyExtra, ...]
    ) -> tuple[KeyExtra, ...] | None:
        """A load: bind the request (if not yet) and resolve its markers to the weights loaded
        now; None (a miss) when not loaded here, or loaded otherwise than when first bound."""
        for e in extras:
            lora_id = marker_id(e)
            if lora_id is not None:
                b = self.bind(req_id, lora_id)
                if b.lora_id != lora_id or b.digest is None or self.current(lora_id) != b.digest:
                    return None
        return self.resolve(extras)

    def resolve_bound(
        self, req_id: str, extras: tuple[KeyExtra, ...]
    ) -> tuple[KeyExtra, ...] | str:
        """A save: ``extras`` with the marker replaced by the digest of the one set of weights
        the request was computed with; else why not (:data:`ADAPTER_UNBOUND`: never bound, or
        the adapter was never loaded while it ran; :data:`ADAPTER_CHANGED`: two sets of weights
        during its life, or a binding older than the history)."""
        if not has_marker(extras):
            return extras
        out = []
        for e in extras:
            lora_id = marker_id(e)
            if lora_id is None:
                out.append(e)
                continue
            with self._lock:
                b = self._binds.get(req_id)
                if b is None or b.lora_id != lora_id:
                    return ADAPTER_UNBOUND
                if b.since < self._forgot:
                    return ADAPTER_CHANGED
                seen = {d for g, i, d in self._history if i == lora_id and g > b.since}
            if b.digest is not None:
                seen.add(b.digest)
            if None in seen or not seen:
                return ADAPTER_UNBOUND
            if len(seen) > 1:
                return ADAPTER_CHANGED
            (digest,) = seen
            assert digest is not None
            out.append(KeyExtra(DIGEST_PREFIX + digest, e.start, e.end))
        return KeyExtra.canonical(out)

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._binds.pop(req_id, None)

    def bound(self) -> int:
        """Requests bound now (a bounded number: running and recently finished ones)."""
        with self._lock:
            return len(self._binds)


def unbound_extras(extras: tuple[KeyExtra, ...]) -> tuple[KeyExtra, ...]:
    """``extras`` with each marker replaced by a key that matches nothing stored: a restore on
    a rank that cannot bind the adapter still runs (its collectives with the other ranks), and
    misses."""
    out = [
        KeyExtra(UNBOUND_PREFIX + os.urandom(16), e.start, e.end)
        if e.key.startswith(MARKER_PREFIX)
        else e
        for e in extras
    ]
    return KeyExtra.canonical(out)


def _target(ref: Any) -> Any:
    return ref() if isinstance(ref, weakref.ref) else ref


_BOOK: AdapterBook | None = None
_BOOK_LOCK = threading.Lock()


def adapter_book() -> AdapterBook:
    """This process's book, with vLLM's LoRA hooks installed on the first call (a worker
    process serves one engine: vLLM's ids are per engine)."""
    global _BOOK
    with _BOOK_LOCK:
        if _BOOK is None:
            _BOOK = AdapterBook()
            _BOOK.hooked = _install(_BOOK)
        return _BOOK


def _install(book: AdapterBook) -> bool:
    """Wrap vLLM's ``LoRAModelManager._add_adapter`` (every adapter registered, after vLLM
    packed its weights) and ``AdapterLRUCache._on_remove`` (every one evicted or removed).
    False (and a log) where vLLM has neither: every LoRA request then misses and is never
    saved."""
    try:
        from vllm.lora.model_manager import AdapterLRUCache, LoRAModelManager
    except Exception as exc:
        book._log.warning("bsr.vllm.adapters_unhooked", error=repr(exc))
        return False
    add = getattr(LoRAModelManager, "_add_adapter", None)
    on_remove = getattr(AdapterLRUCache, "_on_remove", None)
    if add is None or on_remove is None:
        book._log.warning(
            "bsr.vllm.adapters_unhooked",
            note="vLLM's LoRA manager has no _add_adapter/_on_remove: LoRA requests miss",
        )
        return False
    if getattr(add, "_bsr_hook", False):
        return True

    def _add_adapter(self: Any, lora: Any) -> Any:
        out = add(self, lora)
        try:
            book.loaded(lora)
        except Exception as exc:  # bsr never breaks vLLM's load (the adapter stays unbound)
            book._log.warning("bsr.vllm.adapter_hook_failed", error=repr(exc))
        return out

    def _on_remove(self: Any, key: Any, value: Any) -> Any:
        try:
            book.removed(key, value)
        except Exception as exc:
            book._log.warning("bsr.vllm.adapter_hook_failed", error=repr(exc))
        return on_remove(self, key, value)

    _add_adapter._bsr_hook = True  # type: ignore[attr-defined]
    _on_remove._bsr_hook = True  # type: ignore[attr-defined]
    LoRAModelManager._add_adapter = _add_adapter
    AdapterLRUCache._on_remove = _on_remove
    return True
