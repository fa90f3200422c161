#!/usr/bin/env python3
"""Thin entry script: ``python bench/bench.py [flags]`` is ``bsr bench [flags]``.

See bench/README.md for the flags and how to read the output.
"""

from __future__ import annotations

import sys

from bsr_bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
