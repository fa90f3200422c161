"""Quiet by default: bsr prints nothing unless the application configured logging or structlog.

Each case runs in a fresh interpreter, because structlog and logging configuration is global and
the test session configures structlog itself (conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SAVE_RESTORE = """
import anyio, torch, bsr

layout = bsr.StateLayout(chunk_tokens=16, groups=(bsr.StateGroup("kv", 2, 256),))

async def main():
    engine = bsr.RestoreEngine(
        layout,
        [bsr.HostTier(1 << 22), bsr.FileTier(DIR, 1 << 24)],
        window=2, io_depth=2, namespace=bsr.Namespace("quiet"),
    )
    src = bsr.PagedKVCache(layout, 8, 16)
    src.tensor("kv").random_(0, 255)
    tokens = list(range(64))
    async with engine:
        saved = await engine.save(tokens, src, [0, 1, 2, 3])
        assert saved.ok, saved
        dst = bsr.PagedKVCache(layout, 8, 16)
        r = await engine.restore(tokens, dst, [4, 5, 6, 7])
        assert r.committed, r
        miss = await engine.restore(list(range(100, 164)), dst, [4, 5, 6, 7])
        assert miss.committed_tokens == 0

anyio.run(main)
"""


def _run(tmp_path: Path, prelude: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(prelude) + f"\nDIR = {str(tmp_path / 'l2')!r}\n" + SAVE_RESTORE
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHONWARNINGS")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )


def test_unconfigured_process_prints_nothing(tmp_path: Path) -> None:
    p = _run(tmp_path, "")
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    assert p.stderr == ""


def test_unconfigured_process_prints_no_warning_either(tmp_path: Path) -> None:
    # a warning-level event (a tier quarantine) must stay silent too: logging's last-resort
    # handler would print it to stderr without the NullHandler on "bsr"
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "from bsr._log import logger; logger.bind(tier='x').warning('bsr.tier.quarantine')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and p.stdout == "" and p.stderr == "", p


def test_stdlib_logging_sees_events(tmp_path: Path) -> None:
    p = _run(
        tmp_path,
        """
        import logging, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s|%(message)s")
        """,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    done = [ln for ln in lines if ln.startswith("bsr|bsr.restore.done")]
    assert len(done) == 2, p.stdout
    assert "state='Committed'" in done[0] and "model='quiet'" in done[0]
    assert any(ln.startswith("bsr|bsr.save.done") for ln in lines)
    assert any(ln.startswith("bsr|bsr.request.transition") for ln in lines)  # debug level


def test_stdlib_level_filters_and_record_carries_fields(tmp_path: Path) -> None:
    p = _run(
        tmp_path,
        """
        import logging, sys
        class Grab(logging.Handler):
            def emit(self, record):
                print("EVENT", record.bsr_event, sorted(record.bsr_fields), record.levelname)
        logging.getLogger("bsr").addHandler(Grab())
        logging.getLogger("bsr").setLevel(logging.INFO)
        """,
    )
    assert p.returncode == 0, p.stderr
    events = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("EVENT")]
    assert events.count("bsr.restore.done") == 2
    assert "bsr.request.transition" not in events  # debug is below INFO
    line = next(ln for ln in p.stdout.splitlines() if "bsr.restore.done" in ln)
    assert "'committed_tokens'" in line and "'request_id'" in line


@pytest.mark.parametrize("integration", ["plain", "stdlib"])
def test_structlog_renders_when_configured(tmp_path: Path, integration: str) -> None:
    if integration == "plain":
        prelude = """
        import structlog, sys
        structlog.configure(
            processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
            logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        )
        """
    else:
        prelude = """
        import logging, sys, structlog
        fmt = "STD %(name)s %(message)s"
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=fmt)
        structlog.configure(
            processors=[structlog.stdlib.filter_by_level, structlog.processors.JSONRenderer()],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
        )
        """
    p = _run(tmp_path, prelude)
    assert p.returncode == 0, p.stderr
    done = [ln for ln in p.stdout.splitlines() if "bsr.restore.done" in ln]
    assert len(done) == 2, p.stdout
    if integration == "plain":
        assert done[0].startswith("event='bsr.restore.done'") and "rank=0" in done[0]
    else:
        assert done[0].startswith("STD bsr {") and '"committed_tokens": 64' in done[0]
