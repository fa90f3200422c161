"""structlog logger for bsr. The library configures no global logging.

Events are named ``bsr.<area>.<what>`` and carry structured fields (request id, tier, key, group,
from/to state, reason). Configure structlog in your server to route them where you want.
"""

from __future__ import annotations

from typing import Any

import structlog

logger: Any = structlog.get_logger("bsr")
