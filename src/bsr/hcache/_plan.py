"""HCache's per-layer partition: recompute, hidden-state restore or KV restore for each layer.

Where it runs: the serving process, once per model and device (calibration), then per restore
size (planning, microseconds).

How it works: a restore of ``n`` tokens has two resources, the storage path (bytes / measured
read bandwidth) and the compute device (tokens x layers x measured seconds per token-layer).
A KV layer costs only I/O (``2 kv_dim`` values per token), a hidden-state layer I/O
(``hidden`` values) *and* a projection, a recomputed layer (always the first layers: recompute
runs the model from the embeddings) only compute. :func:`plan_layers` tries every split
``recompute [0, r) | hidden [r, r + h) | kv [r + h, L)`` and keeps the fastest under the
executor's timing model:

* ``rates.shared`` (a CPU-only machine, where the reads' verification and installs use the cores
  the model would compute on): nothing overlaps, ``io + recompute + project``;
* ``overlap=True`` (the default: what :class:`~bsr.hcache.HCache` does, projecting each chunk as
  the engine reports it installed, the paper's bubble-free pipeline): ``max(io, recompute +
  project)`` plus the read of the first hidden-state layer group, which nothing can hide;
* ``overlap=False`` (``HCache(pipeline=False)``): recompute runs beside the reads, the
  projection after them: ``max(io, recompute) + project``.

Rates come from :func:`calibrate` (measured once per model, device and tier, cached in-process)
or from the caller (:class:`Rates`), so a plan can be reproduced and a measured machine can be
described to another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import StateGroup, StateLayout
from .._check import int_at_least
from .._errors import ConfigError
from ._arch import ModelShape, check_config, dtype_name

RECOMPUTE = "recompute"
HIDDEN = "hidden"
KV = "kv"


@dataclass(frozen=True)
class Rates:
    """Measured (or given) speeds of this machine for one model.

    Attributes:
        read_bytes_per_s: restore bandwidth of the tier into the cache (read, verify, install).
        project_s_per_token_layer: seconds to rebuild one token's K/V of one layer from its
            hidden state (norm, GEMM, key norm, RoPE, scatter).
        recompute_s_per_token_layer: seconds of a prefill per token and layer (measured at
            ``calibrated_tokens``; attention grows with the prefix, so longer prefixes cost more).
        calibrated_tokens: the prefix length the compute rates were measured at.
        source: ``"measured"`` or ``"given"``.
        shared: compute and the restore's I/O path run on the same cores (a CPU-only machine:
            the reads' verification and installs need the cores the projection would use), so
            their times add up instead of overlapping. :func:`calibrate` sets it for CPU models.
    """

    read_bytes_per_s: float
    project_s_per_token_layer: float
    recompute_s_per_token_layer: float
    calibrated_tokens: int = 0
    source: str = "given"
    shared: bool = False

    def __post_init__(self) -> None:
        for name in (
            "read_bytes_per_s",
            "project_s_per_token_layer",
            "recompute_s_per_token_layer",
        ):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ConfigError(f"Rates.{name} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class PlanCost:
    """Predicted seconds of one split.

    Attributes:
        io_s: storage reads of hidden and KV layers.
        project_s: rebuilding the hidden-state layers.
        recompute_s: recomputing the first layers.
        total_s: under the plan's timing model.
        bytes: bytes read.
    """

    io_s: float
    project_s: float
    recompute_s: float
    total_s: float
    bytes: int


@dataclass(frozen=True)
class LayerPlan:
    """A per-layer restore plan (print it for a table).

    Attributes:
        methods: per model layer, ``"recompute"``, ``"hidden"`` or ``"kv"``.
        num_tokens: the restore size the plan was made for.
        shape: the model's sizes.
        rates: the rates used.
        overlap: the timing model (see the module docstring).
        cost: predicted cost of this plan.
        pure: predicted cost of the pure plans (``"kv"``, ``"hidden"``, ``"recompute"``).
        group_layers: hidden-state layers per state group (restored and rebuilt group by group).
        dtype: the dtype of the stored state.
    """

    methods: tuple[str, ...]
    num_tokens: int
    shape: ModelShape
    rates: Rates
    overlap: bool
    cost: PlanCost
    pure: dict[str, PlanCost] = field(default_factory=dict)
    group_layers: int = 4
    dtype: torch.dtype = torch.float32

    def layers(self, method: str) -> tuple[int, ...]:
        """Model layers restored by ``method``."""
        return tuple(i for i, m in enumerate(self.methods) if m == method)

    @property
    def hidden_groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``(group name, model layers)`` of each hidden-state group, in layer order."""
        hidden = self.layers(HIDDEN)
        g = self.group_layers
        return tuple(
            (f"hidden.{j}", hidden[a : a + g]) for j, a in enumerate(range(0, len(hidden), g))
        )

    @property
    def hidden_bytes(self) -> int:
        return self.shape.hidden * self.dtype.itemsize

    @property
    def kv_bytes(self) -> int:
        return 2 * self.shape.kv_dim * self.dtype.itemsize

    def layout(self, chunk_tokens: int = 256) -> StateLayout:
        """The mixed layout: a ``"kv"`` group for the KV layers, ``"hidden.j"`` groups after it.

        Recomputed layers store nothing. Raises :class:`~bsr.ConfigError` for an all-recompute
        plan (there is nothing to save; prefill instead).
        """
        name = dtype_name(self.dtype)
        groups = []
        kv = self.layers(KV)
        if kv:
            groups.append(StateGroup(KV, len(kv), self.kv_bytes, dtype=name))
        for gname, layers in self.hidden_groups:
            groups.append(StateGroup(gname, len(layers), self.hidden_bytes, dtype=name))
        if not groups:
            raise ConfigError("an all-recompute plan stores nothing; prefill instead")
        return StateLayout(chunk_tokens=chunk_tokens, groups=tuple(groups))

    def __str__(self) -> str:
        runs: list[str] = []
        for m in (RECOMPUTE, HIDDEN, KV):
            ls = self.layers(m)
            if ls:
                runs.append(f"{m} {ls[0]}-{ls[-1]}" if len(ls) > 1 else f"{m} {ls[0]}")
        r = self.rates
        lines = [
            f"HCache plan for {self.num_tokens} tokens, {self.shape.model_type} "
            f"{self.shape.num_layers} layers ({'overlapped' if self.overlap else 'sequential'}"
            f" rebuild): " + ", ".join(runs),
            f"  rates: read {r.read_bytes_per_s / 1e9:.2f} GB/s, project "
            f"{r.project_s_per_token_layer * 1e6:.2f} us/token-layer, recompute "
            f"{r.recompute_s_per_token_layer * 1e6:.2f} us/token-layer ({r.source}"
            + (", compute and I/O share the cores)" if r.shared else ")"),
            f"  {'plan':<10}{'io s':>9}{'project s':>11}{'recompute s':>13}{'total s':>10}"
            f"{'MB':>9}",
        ]
        for name, c in (("this", self.cost), *self.pure.items()):
            lines.append(
                f"  {name:<10}{c.io_s:>9.4f}{c.project_s:>11.4f}{c.recompute_s:>13.4f}"
                f"{c.total_s:>10.4f}{c.bytes / 1e6:>9.1f}"
            )
        return "\n".join(lines)


def _cost(
    s: ModelShape, n: int, r: int, h: int, rates: Rates, overlap: bool, itemsize: int, g: int
) -> PlanCost:
    k = s.num_layers - r - h
    hb, kb = s.hidden * itemsize, 2 * s.kv_dim * itemsize
    nbytes = n * (h * hb + k * kb)
    io = nbytes / rates.read_bytes_per_s
    proj = n * h * rates.project_s_per_token_layer
    rec = n * r * rates.recompute_s_per_token_layer
    if rates.shared:  # one set of cores does everything: nothing overlaps
        total = io + rec + proj
    elif overlap:
        bubble = n * min(g, h) * hb / rates.read_bytes_per_s
        total = max(io, rec + proj + bubble)
    else:
        total = max(io, rec) + proj
    return PlanCost(io, proj, rec, total, nbytes)


def plan_layers(
    config: Any,
    num_tokens: int,
    rates: Rates,
    *,
    overlap: bool = True,
    allow_recompute: bool = True,
    allow_hidden: bool = True,
    group_layers: int = 4,
    dtype: torch.dtype | None = None,
) -> LayerPlan:
    """Choose recompute / hidden-state / KV restore per layer so I/O and compute finish together.

    Args:
        config: the model's config (``model.config``); refused configs raise
            :class:`~bsr.hcache.UnsupportedModelError` when hidden layers would be needed.
        num_tokens: the restore size (tokens).
        rates: from :func:`calibrate`, or given.
        overlap: the timing model (see the module docstring); ``True`` matches
            :class:`~bsr.hcache.HCache`, ``False`` matches ``HCache(pipeline=False)``.
        allow_recompute: whether the first layers may be recomputed.
        allow_hidden: whether hidden-state layers may be used.
        group_layers: hidden-state layers per state group.
        dtype: the stored dtype (default the config's).

    Returns:
        The fastest plan; ties go to fewer bytes, then to fewer recomputed layers.
    """
    int_at_least(num_tokens, "num_tokens", 1)
    int_at_least(group_layers, "group_layers", 1)
    if not isinstance(rates, Rates):
        raise ConfigError("rates must be a bsr.hcache.Rates (see bsr.hcache.calibrate)")
    s = check_config(config)
    dt = dtype or s.dtype
    L, n, item = s.num_layers, num_tokens, dt.itemsize
    best: tuple[tuple[float, int, int], int, int] | None = None
    for r in range(L if allow_recompute else 1):  # at least one stored layer
        for h in range(L - r + 1 if allow_hidden else 1):
            c = _cost(s, n, r, h, rates, overlap, item, group_layers)
            rank = (round(c.total_s, 12), c.bytes, r)
            if best is None or rank < best[0]:
                best = (rank, r, h)
    assert best is not None
    _, r, h = best
    methods = (RECOMPUTE,) * r + (HIDDEN,) * h + (KV,) * (L - r - h)
    pure = {
        "all kv": _cost(s, n, 0, 0, rates, overlap, item, group_layers),
        "all hidden": _cost(s, n, 0, L, rates, overlap, item, group_layers),
        "recompute": PlanCost(
            0.0,
            0.0,
            n * L * rates.recompute_s_per_token_layer,
            n * L * rates.recompute_s_per_token_layer,
            0,
        ),
    }
    return LayerPlan(
        methods,
        n,
        s,
        rates,
        overlap,
        _cost(s, n, r, h, rates, overlap, item, group_layers),
        pure,
        group_layers,
        dt,
    )


def fixed_plan(
    config: Any,
    methods: Sequence[str],
    rates: Rates | None = None,
    *,
    group_layers: int = 4,
    num_tokens: int = 1,
    dtype: torch.dtype | None = None,
) -> LayerPlan:
    """A plan with the given per-layer methods (e.g. all ``"hidden"``), for tests and benches.

    Methods must be ordered recompute, hidden, kv.
    """
    s = check_config(config)
    order = {RECOMPUTE: 0, HIDDEN: 1, KV: 2}
    ms = tuple(methods)
    if len(ms) != s.num_layers or any(m not in order for m in ms):
        raise ConfigError(
            f"methods must give one of {sorted(order)} for each of the {s.num_layers} layers"
        )
    if [order[m] for m in ms] != sorted(order[m] for m in ms):
        raise ConfigError("methods must list recompute layers first, then hidden, then kv")
    rates = rates or Rates(1e9, 1e-9, 1e-9)
    r, h = ms.count(RECOMPUTE), ms.count(HIDDEN)
    dt = dtype or s.dtype
    cost = _cost(s, num_tokens, r, h, rates, False, dt.itemsize, group_layers)
    return LayerPlan(ms, num_tokens, s, rates, False, cost, {}, group_layers, dt)


__all__ = (
    "HIDDEN",
    "KV",
    "RECOMPUTE",
    "LayerPlan",
    "PlanCost",
    "Rates",
    "fixed_plan",
    "plan_layers",
)
