"""HCache-style restoration: store layers' input hidden states, rebuild K/V with a GEMM.

Where it runs: the serving process, next to a Hugging Face ``transformers`` model (optional extra
``bsr-kv[hf]``).

How it works (HCache, EuroSys'25): a layer's K/V are a projection of the hidden state entering
it, so a store may keep that hidden state instead (half the bytes of K+V for MHA models, more
for GQA) and rebuild K/V on restore with one GEMM per layer, no attention and no MLP. The pieces:

* :data:`SUPPORTED_ARCHITECTURES`, :func:`check_config` and :func:`check_model`: a model is
  accepted only when its architecture is in the table *and* the K/V rebuilt from its own hidden
  states match its own K/V on a token sample; otherwise :class:`UnsupportedModelError`.
* :func:`plan_layers` with :func:`calibrate`: per layer recompute, hidden-state or KV restore
  from measured read bandwidth and projection/recompute throughput (:class:`LayerPlan`, printable,
  with the mixed :class:`~bsr.StateLayout` the engine saves and restores).
* :class:`HCache`: capture hooks during prefill and decode (:class:`HiddenCapture`), save and
  restore through a :class:`~bsr.RestoreEngine`, projection straight into the serving
  :class:`~bsr.PagedKVCache` with RoPE computed once per restore.
* :func:`hidden_layout`, :func:`write_hidden_to_cache`, :func:`rebuild_kv` and
  :func:`compare_state_bytes`: the single-group (every layer hidden) building blocks.
"""

from __future__ import annotations

from .._errors import UnsupportedModelError as UnsupportedModelError
from ._arch import SUPPORTED_ARCHITECTURES as SUPPORTED_ARCHITECTURES
from ._arch import ArchSupport as ArchSupport
from ._arch import ModelAdapter as ModelAdapter
from ._arch import check_config as check_config
from ._calibrate import calibrate as calibrate
from ._calibrate import calibration_key as calibration_key
from ._calibrate import measure_compute as measure_compute
from ._calibrate import measure_read as measure_read
from ._plan import HIDDEN as HIDDEN
from ._plan import KV as KV
from ._plan import RECOMPUTE as RECOMPUTE
from ._plan import LayerPlan as LayerPlan
from ._plan import PlanCost as PlanCost
from ._plan import Rates as Rates
from ._plan import fixed_plan as fixed_plan
from ._plan import plan_layers as plan_layers
from ._session import HCache as HCache
from ._session import HCacheRestore as HCacheRestore
from ._session import HiddenCapture as HiddenCapture
from ._state import HIDDEN_GROUP as HIDDEN_GROUP
from ._state import StateBytes as StateBytes
from ._state import compare_state_bytes as compare_state_bytes
from ._state import hidden_layout as hidden_layout
from ._state import rebuild_kv as rebuild_kv
from ._state import rebuild_rows as rebuild_rows
from ._state import write_hidden_to_cache as write_hidden_to_cache
from ._verify import CheckReport as CheckReport
from ._verify import check_model as check_model

__all__ = (
    "HIDDEN",
    "HIDDEN_GROUP",
    "KV",
    "RECOMPUTE",
    "SUPPORTED_ARCHITECTURES",
    "ArchSupport",
    "CheckReport",
    "HCache",
    "HCacheRestore",
    "HiddenCapture",
    "LayerPlan",
    "ModelAdapter",
    "PlanCost",
    "Rates",
    "StateBytes",
    "UnsupportedModelError",
    "calibrate",
    "calibration_key",
    "check_config",
    "check_model",
    "compare_state_bytes",
    "fixed_plan",
    "hidden_layout",
    "measure_compute",
    "measure_read",
    "plan_layers",
    "rebuild_kv",
    "rebuild_rows",
    "write_hidden_to_cache",
)
