"""Which models HCache can rebuild exactly, and the per-layer K/V projection for those it can.

Where it runs: the serving process, next to a Hugging Face ``transformers`` model.

How it works: a layer's K/V is a function of the hidden state entering it. For the decoder layers
in :data:`SUPPORTED_ARCHITECTURES` that function is ``K = RoPE(k_norm(W_k norm(h) + b_k))``,
``V = W_v norm(h) + b_v``, where ``norm`` is the layer's input norm (OLMo2 has none: its norms
follow the sublayers) and ``k_norm`` is Qwen3's per-head or OLMo2's full-width key norm.
:class:`ModelAdapter` holds, per layer, the input norm, one fused ``[W_k; W_v]`` weight (for Phi3 a
slice of the fused ``qkv_proj``) and the key norm, so one GEMM yields a token's cache row
``[K heads..., V heads...]`` (the row layout of :mod:`bsr.hf`). RoPE is applied by
:func:`apply_rope` with cos/sin computed once per restore.

The table alone proves nothing about a particular checkpoint, so :func:`bsr.hcache.check_model`
also compares the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import UnsupportedModelError
from .._model_config import attention_shape, config_dtype, config_int, sliding_window, text_config

__all__ = (
    "SUPPORTED_ARCHITECTURES",
    "ArchSupport",
    "ModelAdapter",
    "ModelShape",
    "RopeTable",
    "apply_rope",
    "check_config",
    "model_shape",
)


@dataclass(frozen=True)
class ArchSupport:
    """One row of the supported-architecture table.

    Attributes:
        model_type: the config's ``model_type``.
        supported: whether hidden-state rebuild is implemented for it.
        projection: where K/V come from.
        norm: what the hidden state passes through before the projection.
        key_norm: the norm applied to K before RoPE, if any.
        note: conditions, or why it is refused.
    """

    model_type: str
    supported: bool
    projection: str
    norm: str
    key_norm: str
    note: str = ""


SUPPORTED_ARCHITECTURES: dict[str, ArchSupport] = {
    a.model_type: a
    for a in (
        ArchSupport("llama", True, "k_proj, v_proj", "input_layernorm", "-", "MHA and GQA"),
        ArchSupport(
            "mistral", True, "k_proj, v_proj", "input_layernorm", "-", "sliding_window=None only"
        ),
        ArchSupport(
            "qwen2", True, "k_proj, v_proj (+bias)", "input_layernorm", "-", "no sliding layers"
        ),
        ArchSupport("gemma", True, "k_proj, v_proj", "input_layernorm (1 + w)", "-"),
        ArchSupport(
            "qwen3", True, "k_proj, v_proj", "input_layernorm", "k_norm per head", "no sliding"
        ),
        ArchSupport(
            "phi3",
            True,
            "qkv_proj rows [q_dim, q_dim + 2 kv_dim)",
            "input_layernorm",
            "-",
            "partial rotary supported; longrope refused",
        ),
        ArchSupport(
            "olmo2", True, "k_proj, v_proj", "none (post-sublayer norms)", "k_norm over all heads"
        ),
        ArchSupport(
            "deepseek_v3",
            False,
            "-",
            "-",
            "-",
            "MLA: K/V are decompressed from a latent (kv_lora_rank) with a decoupled RoPE key; "
            "store the latent with a custom StateLayout instead",
        ),
        ArchSupport("gemma2", False, "-", "-", "-", "alternating sliding-window layers"),
        ArchSupport("gemma3_text", False, "-", "-", "-", "sliding layers with their own RoPE base"),
    )
}

#: RoPE variants whose cos/sin depend only on the position (not on the sequence length seen)
_STATIC_ROPE = frozenset({"default", "linear", "llama3", "yarn"})


def dtype_name(dtype: torch.dtype) -> str:
    """The layout's name of a torch dtype (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelShape:
    """The sizes HCache needs from a config.

    Attributes:
        model_type: the config's ``model_type``.
        num_layers: decoder layers.
        hidden: hidden size (values per token of a layer's input hidden state).
        num_heads: attention (query) heads.
        kv_heads: KV heads.
        head_dim: values per head.
        dtype: the config's dtype.
    """

    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def kv_dim(self) -> int:
        """Values of K (or of V) per token and layer."""
        return self.kv_heads * self.head_dim


def _refuse(model_type: str, missing: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"bsr.hcache cannot rebuild K/V exactly for model_type={model_type!r}: {missing}; store "
        "K/V for this model (bsr.hf.layout_for_config)",
        model_type=model_type,
    )


def check_config(config: Any) -> ModelShape:
    """Check a config against :data:`SUPPORTED_ARCHITECTURES`; return its sizes.

    Raises:
        UnsupportedModelError: naming the missing piece (architecture not in the table, sliding
            window layers, MLA, a RoPE variant whose cos/sin depend on the sequence length).
    """
    cfg = text_config(config)
    mt = str(getattr(cfg, "model_type", "") or "")
    arch = SUPPORTED_ARCHITECTURES.get(mt)
    if getattr(cfg, "kv_lora_rank", None):
        raise _refuse(mt, "MLA (latent) attention has no per-head K/V to project")
    if arch is None:
        known = ", ".join(k for k, a in SUPPORTED_ARCHITECTURES.items() if a.supported)
        raise _refuse(mt, f"the architecture is not in the supported table ({known})")
    if not arch.supported:
        raise _refuse(mt, arch.note)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise _refuse(mt, f"non-full-attention layers {sorted(set(layer_types))}")
    window = None if layer_types else sliding_window(cfg, UnsupportedModelError)
    if window is not None:
        raise _refuse(mt, f"sliding_window={window} (a windowed cache drops tokens)")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = str(rope.get("rope_type", rope.get("type", "default")) or "default")
    if rope_type not in _STATIC_ROPE:
        raise _refuse(mt, f"rope_type={rope_type!r} (cos/sin depend on the sequence length)")
    # read as bsr.hf reads them (bsr._model_config), so the K/V rebuilt here have the shape
    # and dtype of the K/V bsr.hf stores for the same config
    layers = config_int(cfg, "num_hidden_layers", UnsupportedModelError)
    hidden = config_int(cfg, "hidden_size", UnsupportedModelError)
    a = attention_shape(cfg, UnsupportedModelError)
    return ModelShape(mt, layers, hidden, a.num_heads, a.kv_heads, a.head_dim, config_dtype(cfg))


def model_shape(config: Any) -> ModelShape:
    """:func:`check_config` (kept as the name the planner and layouts use)."""
    return check_config(config)


def apply_rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate ``k`` ``[n, heads, head_dim]`` in place with HF's ``rotate_half`` convention.

    ``cos``/``sin`` are ``[n, rot_dim]`` (computed once per restore by the model's rotary
    module); dims past ``rot_dim`` pass through (partial rotary). Same arithmetic as
    ``apply_rotary_pos_emb``: ``x1 c1 - x2 s1`` and ``x2 c2 + x1 s2``.
    """
    rd = cos.shape[-1]
    half = rd // 2
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)
    x1 = k[..., :half]
    x2 = k[..., half:rd]
    first = x1 * c[..., :half]
    first -= x2 * s[..., :half]
    second = x2 * c[..., half:]
    second += x1 * s[..., half:]
    x1.copy_(first)
    x2.copy_(second)


@dataclass
class _LayerProj:
    norm: Callable[[torch.Tensor], torch.Tensor] | None
    weight: torch.Tensor  # [2 kv_dim, hidden]
    bias: torch.Tensor | None
    key_norm: Callable[[torch.Tensor], torch.Tensor] | None
    key_norm_per_head: bool
    #: fast path (see ``ModelAdapter._fold``): ``[W_k; W_v]`` with the norm weight folded in
    wkv: torch.Tensor | None = None
    eps: float = 0.0


@dataclass(frozen=True)
class RopeTable:
    """RoPE cos/sin of a run of positions, computed once per restore and sliced per piece.

    Attributes:
        cos: ``[n, rot_dim]`` in the model dtype.
        sin: likewise.
        paired: the table rotates whole heads and its halves repeat (standard RoPE): the fast
            path then rotates with the first halves only.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    paired: bool

    def __getitem__(self, sel: Any) -> RopeTable:
        return RopeTable(self.cos[sel], self.sin[sel], self.paired)

    def __len__(self) -> int:
        return int(self.cos.shape[0])


class ModelAdapter:
    """Per-layer K/V projection of one supported model (see the module docstring).

    Args:
        model: a ``transformers`` causal LM (or its inner model) whose config passes
            :func:`check_config`.

    Raises:
        UnsupportedModelError: the config is refused, or a module the rebuild needs is missing.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.shape = check_config(model.config)
        inner = getattr(model, "model", model)
        layers = getattr(inner, "layers", None)
        rotary = getattr(inner, "rotary_emb", None)
        mt = self.shape.model_type
        if layers is None or rotary is None:
            raise _refuse(mt, "the model has no model.layers / model.rotary_emb")
        self.layers: Any = layers
        self.rotary: Any = rotary
        self._proj: list[_LayerProj] = [self._layer(i) for i in range(self.shape.num_layers)]
        self._stacks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype

    def _layer(self, i: int) -> _LayerProj:
        s = self.shape
        layer = self.layers[i]
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise _refuse(s.model_type, f"layer {i} has no self_attn")
        kd = s.kv_dim
        if s.model_type == "phi3":
            qkv = getattr(attn, "qkv_proj", None)
            if qkv is None:
                raise _refuse(s.model_type, f"layer {i} has no fused qkv_proj")
            q = s.num_heads * s.head_dim
            if qkv.weight.shape[0] != q + 2 * kd:
                raise _refuse(s.model_type, f"layer {i} qkv_proj has an unexpected shape")
            weight = qkv.weight.detach()[q : q + 2 * kd]
            bias = None if qkv.bias is None else qkv.bias.detach()[q : q + 2 * kd]
        else:
            kp, vp = getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)
            if kp is None or vp is None:
                raise _refuse(s.model_type, f"layer {i} has no k_proj/v_proj")
            weight = torch.cat((kp.weight.detach(), vp.weight.detach()), 0)
            bias = None
            if kp.bias is not None or vp.bias is not None:
                zeros = torch.zeros(kd, dtype=weight.dtype, device=weight.device)
                kb = kp.bias.detach() if kp.bias is not None else zeros
                vb = vp.bias.detach() if vp.bias is not None else zeros
                bias = torch.cat((kb, vb))
        if weight.shape != (2 * kd, s.hidden):
            raise _refuse(s.model_type, f"layer {i} K/V projections are not [{kd}, {s.hidden}]")
        if s.model_type == "olmo2":
            norm = None
        else:
            norm = getattr(layer, "input_layernorm", None)
            if norm is None:
                raise _refuse(s.model_type, f"layer {i} has no input_layernorm")
        key_norm = getattr(attn, "k_norm", None)
        if s.model_type in ("qwen3", "olmo2") and key_norm is None:
            raise _refuse(s.model_type, f"layer {i} has no k_norm")
        if s.model_type not in ("qwen3", "olmo2") and key_norm is not None:
            raise _refuse(s.model_type, f"layer {i} has a k_norm this table does not expect")
        proj = _LayerProj(norm, weight.contiguous(), bias, key_norm, s.model_type == "qwen3")
        self._fold(proj)
        return proj

    def _fold(self, p: _LayerProj) -> None:
        """Prepare the fast path of a layer whose input norm is a plain RMSNorm.

        ``W (w * h * r) = r * ((W * w) h)`` with ``r = rsqrt(mean(h^2) + eps)`` per token, so
        the norm becomes one reduction and a row scale after the GEMM, and the layer's K and V
        come out of one GEMM with ``[W_k; W_v] * w`` (folded in float64, stored in the model's
        dtype) already in the cache's row order. Not for key norms (Qwen3, OLMo2), which take
        the module-by-module path.
        """
        s = self.shape
        norm = p.norm
        if norm is None or p.key_norm is not None or not type(norm).__name__.endswith("RMSNorm"):
            return
        if s.head_dim % 2 or not p.weight.dtype.is_floating_point:
            return
        w = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if not isinstance(w, torch.Tensor) or not isinstance(eps, float) or w.shape != (s.hidden,):
            return
        scale = w.detach().double() + (1.0 if s.model_type == "gemma" else 0.0)
        p.wkv = (p.weight.double() * scale).to(p.weight.dtype).contiguous()
        p.eps = eps

    @property
    def row_elems(self) -> int:
        """Values of one token's cache row ``[K heads..., V heads...]``."""
        return 2 * self.shape.kv_dim

    def rope(self, start: int, stop: int) -> RopeTable:
        """RoPE of positions ``[start, stop)`` from the model's own rotary module (once)."""
        pos = torch.arange(start, stop, device=self.device).unsqueeze(0)
        probe = torch.empty(1, stop - start, 1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)
        cos, sin = cos[0], sin[0]
        rd = cos.shape[-1]
        paired = (
            rd == self.shape.head_dim
            and torch.equal(cos[:, : rd // 2], cos[:, rd // 2 :])
            and torch.equal(sin[:, : rd // 2], sin[:, rd // 2 :])
        )
        return RopeTable(cos, sin, paired)

    def fast(self, layer: int, rope: RopeTable) -> bool:
        """Whether ``layer`` takes the folded-norm path (one GEMM, RoPE on its output)."""
        return self._proj[layer].wkv is not None and rope.paired

    def project_into(
        self,
        layer: int,
        h: torch.Tensor,
        rope: RopeTable,
        out: torch.Tensor,
        tmp: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write the cache rows ``[m, 2 kv_dim]`` (``[K | V]``) of ``layer`` into ``out``.

        ``h`` is ``[m, hidden]``; ``out`` a contiguous ``[>= m, 2 kv_dim]`` buffer of the model's
        dtype, which must not overlap ``h``; ``tmp`` an optional reusable buffer of at least
        ``m x kv_dim / 2`` values for RoPE (else one is allocated). On the fast path
        (:meth:`fast`) it is one GEMM into ``out``, the norm's row scale and the bias on its
        output, and RoPE on its K half as five elementwise operations on whole
        ``[m, heads, head_dim / 2]`` views: a constant number of kernels per call, whatever
        ``m``, and no allocation the size of the rows. Else the module-by-module arithmetic,
        copied in. Returns ``out[:m]``.
        """
        m = h.shape[0]
        rows = out[:m]
        p = self._proj[layer]
        if not self.fast(layer, rope):
            rows.copy_(self._project_modules(layer, h, rope))
            return rows
        assert p.wkv is not None
        torch.mm(h, p.wkv.t(), out=rows)
        return self._scale_and_rotate(rows, h, rope, p.eps, p.bias, tmp)

    def groupable(self, layers: Sequence[int], rope: RopeTable) -> bool:
        """Whether ``layers`` can be projected together (:meth:`project_group_into`): all on
        the fast path, with one norm epsilon and all or none with a bias."""
        ps = [self._proj[i] for i in layers]
        return (
            len(ps) > 1
            and all(self.fast(i, rope) for i in layers)
            and len({p.eps for p in ps}) == 1
            and len({p.bias is None for p in ps}) == 1
        )

    def _stacked(self, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[G, hidden, 2 kv_dim]`` fused weights (transposed) of ``layers``, and their
        ``[G, 1, 2 kv_dim]`` biases; made once per group of layers."""
        got = self._stacks.get(layers)
        if got is None:
            ps = [self._proj[i] for i in layers]
            wt = torch.stack([p.wkv.t() for p in ps if p.wkv is not None]).contiguous()
            bias = None
            if ps[0].bias is not None:
                bias = torch.stack([p.bias for p in ps if p.bias is not None]).unsqueeze(1)
            got = self._stacks[layers] = (wt, bias)
        return got

    def project_group_into(
        self,
        layers: Sequence[int],
        h: torch.Tensor,
        rope: RopeTable,
        out: torch.Tensor,
        tmp: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`project_into` of several layers at once (:meth:`groupable` ones): ``h`` is
        ``[G, m, hidden]``, ``out`` a contiguous ``[G, m, 2 kv_dim]`` buffer, ``tmp`` at least
        ``G x m x kv_dim / 2`` values. One batched GEMM and the same elementwise operations on
        ``[G, m, ...]`` views: the kernels of one layer for the whole group. Returns ``out``.
        """
        wt, bias = self._stacked(tuple(layers))
        torch.bmm(h, wt, out=out)
        return self._scale_and_rotate(out, h, rope, self._proj[layers[0]].eps, bias, tmp)

    def _scale_and_rotate(
        self,
        rows: torch.Tensor,
        h: torch.Tensor,
        rope: RopeTable,
        eps: float,
        bias: torch.Tensor | None,
        tmp: torch.Tensor | None,
    ) -> torch.Tensor:
        """The fast path after its GEMM, on ``rows`` ``[..., m, 2 kv_dim]`` (one layer, or a
        group's ``[G, m, ...]``) from ``h`` ``[..., m, hidden]``: the norm's row scale (for K
        on RoPE's factors), the bias, then RoPE on the K half, five elementwise operations
        whatever the shape. ``tmp``: at least ``rows.numel() / 4`` values, else allocated."""
        s = self.shape
        ss = torch.linalg.vector_norm(h, dim=-1, keepdim=True, dtype=torch.float32)
        r = torch.rsqrt(ss.square_().div_(s.hidden).add_(eps)).to(rows.dtype)  # [..., m, 1]
        half = s.head_dim // 2
        c = rope.cos[:, :half].unsqueeze(1)  # [m, 1, half]
        sn = rope.sin[:, :half].unsqueeze(1)
        if bias is not None:
            rows.mul_(r).add_(bias)
        else:  # K's row scale rides on the rotation's factors (m x half values, not m x kv_dim)
            rows[..., s.kv_dim :].mul_(r)
            r4 = r.unsqueeze(-1)  # [..., m, 1, 1]
            c, sn = c * r4, sn * r4
        lead = rows.shape[:-1]
        k = rows[..., : s.kv_dim].view(*lead, s.kv_heads, 2, half)
        x, y = k[..., 0, :], k[..., 1, :]
        n_half = rows.numel() // 4  # lead x kv_heads x half
        if tmp is None or tmp.numel() < n_half:
            tmp = rows.new_empty(n_half)
        xs = torch.mul(x, sn, out=tmp[:n_half].view(*lead, s.kv_heads, half))  # x s, first
        x.mul_(c).addcmul_(y, sn, value=-1)  # x c - y s
        y.mul_(c).add_(xs)  # y c + x s
        return rows

    def project(self, layer: int, h: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """Cache rows ``[n, 2 kv_dim]`` (``[K | V]``) of ``layer`` from its input hidden states.

        The same arithmetic as :meth:`project_into` (what :func:`check_model` verifies).

        Args:
            layer: model layer index.
            h: ``[n, hidden]`` input hidden states of the layer.
            rope: from :meth:`rope`, sliced to the tokens of ``h``.
        """
        if self.fast(layer, rope):
            return self.project_into(layer, h, rope, h.new_empty(h.shape[0], self.row_elems))
        return self._project_modules(layer, h, rope)

    def _project_modules(self, layer: int, h: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """The module-by-module path: the layer's own norm, one GEMM, key norm, RoPE."""
        s = self.shape
        n = h.shape[0]
        p = self._proj[layer]
        x = p.norm(h) if p.norm is not None else h
        if p.bias is not None:
            rows = torch.addmm(p.bias, x, p.weight.t())
        else:
            rows = torch.mm(x, p.weight.t())
        k = rows[:, : s.kv_dim]
        if p.key_norm is not None:
            if p.key_norm_per_head:
                k.copy_(p.key_norm(k.view(n, s.kv_heads, s.head_dim)).view(n, s.kv_dim))
            else:
                k.copy_(p.key_norm(k))
        apply_rope(k.view(n, s.kv_heads, s.head_dim), rope.cos, rope.sin)
        return rows
