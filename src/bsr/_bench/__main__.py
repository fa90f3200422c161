"""``python -m bsr._bench``: the same as ``bsr bench``."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
