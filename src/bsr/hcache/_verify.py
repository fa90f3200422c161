"""The numeric self-check: K/V rebuilt from captured hidden states against the model's own.

Where it runs: the serving process, once per model (:func:`check_model`) and on the first
captured forward of a request (:class:`~bsr.hcache.HiddenCapture`).

How it works: hooks capture each layer's input hidden state during a real forward; the rebuild
(:meth:`ModelAdapter.project`, exactly the arithmetic a restore uses) runs on a sample of tokens
and is compared with the K/V the model cached, as ``max|rebuilt - model| / max|model|`` against a
bound per dtype. A model that fails is refused with :class:`~bsr.hcache.UnsupportedModelError`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import UnsupportedModelError
from .._model_config import text_config
from ._arch import ModelAdapter

__all__ = ("CheckReport", "check_model", "compare_rows")

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@dataclass(frozen=True)
class CheckReport:
    """Outcome of :func:`check_model`.

    Attributes:
        model_type: the config's ``model_type``.
        max_error: largest ``|rebuilt - model| / max|model|`` over layers and K/V.
        tolerance: the dtype's bound.
        worst_layer: the layer of ``max_error``.
        tokens: tokens sampled.
    """

    model_type: str
    max_error: float
    tolerance: float
    worst_layer: int
    tokens: int

    @property
    def ok(self) -> bool:
        return self.max_error <= self.tolerance


def compare_rows(
    adapter: ModelAdapter,
    hidden: list[torch.Tensor],
    positions: torch.Tensor,
    model_kv: list[tuple[torch.Tensor, torch.Tensor]],
    layers: Sequence[int] | None = None,
) -> CheckReport:
    """Rebuild rows at ``positions`` from ``hidden[j]`` ``[n, hidden]`` and compare with the model.

    ``model_kv[j]`` is ``(K, V)`` of model layer ``layers[j]`` (default ``j``), each
    ``[kv_heads, n, head_dim]`` for the same ``n`` tokens (positions are absolute; rows of
    ``hidden`` and ``model_kv`` follow them).
    """
    s = adapter.shape
    worst, worst_layer = 0.0, 0
    layer_ids = list(range(len(hidden))) if layers is None else list(layers)
    with torch.no_grad():
        rope = adapter.rope(0, int(positions.max()) + 1)[positions]
        for i, h in zip(layer_ids, hidden):
            rows = adapter.project(i, h.to(adapter.device, adapter.dtype), rope)
            k, v = model_kv[layer_ids.index(i)]
            ref = torch.cat(
                (k.transpose(0, 1).reshape(-1, s.kv_dim), v.transpose(0, 1).reshape(-1, s.kv_dim)),
                1,
            ).to(rows.device, torch.float64)
            err = (rows.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
            if err > worst or err != err:  # NaN is a failure
                worst, worst_layer = (float("inf") if err != err else err), i
    return CheckReport(
        s.model_type, worst, _TOLERANCE.get(adapter.dtype, 1e-2), worst_layer, len(positions)
    )


_VERDICTS: weakref.WeakKeyDictionary[Any, CheckReport] = weakref.WeakKeyDictionary()


def check_model(
    model: Any, *, tokens: int = 24, seed: int = 0, refresh: bool = False
) -> CheckReport:
    """Prove on ``tokens`` random tokens that the rebuild reproduces this model's own K/V.

    Runs one forward with hooks that capture each layer's input hidden state and compares the
    rebuilt K/V with the K/V the model cached. The verdict is cached per model object.

    Raises:
        UnsupportedModelError: the architecture is refused, or the rebuilt K/V differ (the
            message gives the error, the tolerance and the layer).
    """
    if not refresh and model in _VERDICTS:
        report = _VERDICTS[model]
    else:
        adapter = ModelAdapter(model)
        vocab = int(getattr(text_config(model.config), "vocab_size", 32) or 32)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (1, tokens), generator=g).to(adapter.device)
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for i in range(adapter.shape.num_layers):

            def hook(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
                h = args[0] if args else kwargs["hidden_states"]
                captured[i] = h[0].detach().clone()

            handles.append(adapter.layers[i].register_forward_pre_hook(hook, with_kwargs=True))
        try:
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
        finally:
            for hd in handles:
                hd.remove()
        from ..hf import _model_layers

        past = getattr(out, "cache", None) or out.past_key_values
        kv = [(k[0], v[0]) for k, v, _ in _model_layers(past)]
        report = compare_rows(
            adapter,
            [captured[i] for i in range(adapter.shape.num_layers)],
            torch.arange(tokens, device=adapter.device),
            kv,
        )
        _VERDICTS[model] = report
    if not report.ok:
        raise UnsupportedModelError(
            f"hidden-state rebuild of this {report.model_type} model differs from its own K/V "
            f"(relative error {report.max_error:.3g} > {report.tolerance:g} at layer "
            f"{report.worst_layer}); hidden-state saving is refused, store K/V instead",
            model_type=report.model_type,
            layer=report.worst_layer,
        )
    return report
