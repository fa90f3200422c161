"""`bsr bench` is a thin entry into the bench package (bench/bsr_bench, the bsr-bench distribution).

The library's CLI loads nothing of the bench until `bsr bench` runs, hands every argument after
`bench` to the bench's own parser (same flags as before the bench left the package), and says how
to install the bench when it is missing. Each check runs in a fresh interpreter, so what it sees
in `sys.modules` is what the command imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: every `bsr bench` flag and its default, as before the bench moved out of src/bsr (scripts
#: call `bsr bench --device cuda`, `--l1-ladder`, `--hcache`, `--engine vllm`, `--quick`, ...)
FLAGS = {
    "--cache": "auto",
    "--destination": "auto",
    "--device": "cpu",
    "--engine": "bsr",
    "--hcache": False,
    "--hcache-shape": "toy",
    "--io-depth": None,
    "--io-depths": None,
    "--json": None,
    "--keep": False,
    "--l1-ladder": False,
    "--ladder-budgets": None,
    "--ladder-max-window": 32,
    "--ladder-sizes": None,
    "--layout": None,
    "--lmcache": "auto",
    "--log-level": "warning",
    "--model-size": None,
    "--no-concurrency": False,
    "--no-cpu": False,
    "--no-fio": False,
    "--no-overhead": False,
    "--no-plots": False,
    "--no-recompute": False,
    "--no-sweep": False,
    "--path": None,
    "--plots": None,
    "--quick": False,
    "--remote": "none",
    "--repeats": None,
    "--seed": 0,
    "--sizes": None,
    "--sweep-tokens": None,
    "--tp": None,
    "--ssd-concurrency": False,
    "--striped": False,
    "--striped-roots": None,
    "--striped-bytes": None,
    "--ssd-depths": None,
    "--vllm-interference-arrivals": None,
    "--vllm-interference-layers": None,
    "--vllm-interference-prefix": None,
    "--vllm-interference-variants": None,
    "--vllm-prefixes": None,
    "--vllm-python": None,
    "--vllm-repeats": None,
    "--vllm-model": "llama",
    "--vllm-checkpoint-intervals": None,
    "--vllm-cost": False,
    "--vllm-cost-prefixes": None,
    "--vllm-cost-slow-mbps": None,
    "--vllm-cost-tokens": None,
    "--vllm-sections": None,
    "--vllm-warm": False,
    "--vllm-warm-leads": None,
    "--vllm-fleet": False,
    "--vllm-fleet-conversations": None,
    "--vllm-fleet-turns": None,
    "--vllm-fleet-prefix": None,
    "--vllm-fleet-gpu-tokens": None,
    "--vllm-fleet-pd-prompts": None,
    "--window": None,
    "--windows": None,
}


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter in ``cwd`` (where a bench run would write)."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def _imports_of(tmp_path: Path, argv: list[str] | None) -> dict[str, list[str]]:
    """Modules loaded by `import bsr`, then by `import bsr.cli` and `bsr <argv>` on top of it."""
    out = tmp_path / "modules.json"
    run = (
        "" if argv is None else f"\ntry:\n    bsr.cli.main({argv!r})\nexcept SystemExit:\n    pass"
    )
    code = (
        "import json, sys\nimport bsr\nbase = set(sys.modules)\nimport bsr.cli"
        + run
        + f"\nnew = sorted(set(sys.modules) - base)\n"
        f"open({str(out)!r}, 'w').write(json.dumps({{'base': sorted(base), 'new': new}}))"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, list[str]] = json.loads(out.read_text())
    return doc


def _outside_stdlib_and_bsr(modules: list[str]) -> list[str]:
    return [
        m
        for m in modules
        if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "bsr"
    ]


@pytest.mark.parametrize("argv", [None, ["--help"], ["spec", "diagram", "--help"]])
def test_the_cli_loads_nothing_of_the_bench(tmp_path: Path, argv: list[str] | None) -> None:
    """`import bsr.cli`, `bsr --help`: only the standard library on top of `import bsr` (no
    bench module, no psutil, rich, matplotlib, jsonschema or transformers)."""
    doc = _imports_of(tmp_path, argv)
    bench = [m for m in doc["new"] if m.startswith(("bsr_bench", "bsr._bench"))]
    assert bench == [], f"bsr {argv} imported the bench: {bench}"
    assert _outside_stdlib_and_bsr(doc["new"]) == [], argv
    assert "bsr.cli" in doc["new"]


def test_the_cli_does_not_import_torch(tmp_path: Path) -> None:
    """`import bsr.cli` and `bsr --help` stay light: the facade imports its names on first use."""
    out = tmp_path / "modules.json"
    code = (
        "import json, sys\nimport bsr.cli\ntry:\n    bsr.cli.main(['--help'])\n"
        "except SystemExit:\n    pass\n"
        f"open({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules)))"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    modules = set(json.loads(out.read_text()))
    assert "torch" not in modules and "numpy" not in modules


def test_bench_flags_and_defaults_are_stable() -> None:
    from bsr_bench.cli import build_parser

    parser = build_parser()
    by_flag: dict[str, Any] = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                by_flag[flag] = action.default
    assert by_flag == FLAGS
    assert parser.parse_args(["-W", "4"]).window == 4  # the short flag of --window


def test_bsr_bench_hands_every_argument_to_the_bench() -> None:
    from bsr.cli import build_parser

    argv = ["--device", "cuda", "-W", "4", "--layout", "x", "--quick", "-h", "--version"]
    ns = build_parser().parse_args(["bench", *argv])
    assert ns.bench_args == argv
    assert build_parser().parse_args(["bench"]).bench_args == []


def test_bsr_bench_help_lists_every_flag(tmp_path: Path) -> None:
    """`python -m bsr bench --help` (and so `bsr bench --help`) prints the bench's own help."""
    proc = subprocess.run(
        [sys.executable, "-m", "bsr", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: bsr bench")
    for flag in FLAGS:
        assert flag in proc.stdout, flag


def test_bench_errors_exit_2_through_bsr_bench(tmp_path: Path) -> None:
    code = "import sys\nfrom bsr.cli import main\nsys.exit(main({argv!r}))"
    bad_value = _python(
        code.format(argv=["bench", "--quick", "-W", "2", "--io-depth", "4"]), tmp_path
    )
    assert bad_value.returncode == 2
    assert "bsr bench: error: --io-depth must be in [1, W=2], got 4" in bad_value.stderr
    ladder = _python(code.format(argv=["bench", "--l1-ladder", "--ladder-sizes", "x"]), tmp_path)
    assert ladder.returncode == 2
    assert "bsr bench --l1-ladder: error: --ladder-sizes: expected" in ladder.stderr
    unknown = _python(code.format(argv=["bench", "--no-such-flag"]), tmp_path)
    assert unknown.returncode == 2
    assert "usage: bsr bench" in unknown.stderr and "--no-such-flag" in unknown.stderr


def test_without_the_bench_bsr_bench_says_how_to_install_it(tmp_path: Path) -> None:
    """A bsr without the bench package: `bsr bench` exits 2 and names `make bench` and
    `pip install -e bench/`; the rest of the CLI, `bsr --help` included, works."""
    hide = "import sys\nsys.modules['bsr_bench'] = None  # as if bsr-bench were not installed\n"
    run = hide + "from bsr.cli import main\nsys.exit(main({argv!r}))"
    proc = _python(run.format(argv=["bench", "--quick"]), tmp_path)
    assert proc.returncode == 2
    assert "the benchmark is not installed" in proc.stderr
    assert "make bench" in proc.stderr and "pip install -e bench/" in proc.stderr
    assert "Traceback" not in proc.stderr
    helped = _python(run.format(argv=["--help"]), tmp_path)
    assert helped.returncode == 0 and "bench" in helped.stdout
    spec = _python(run.format(argv=["spec", "diagram"]), tmp_path)
    assert spec.returncode == 0 and "stateDiagram" in spec.stdout


def test_a_missing_dependency_of_the_bench_is_named(tmp_path: Path) -> None:
    code = (
        "import sys\nsys.modules['psutil'] = None  # the bench imports it; bsr does not\n"
        "from bsr.cli import main\nsys.exit(main(['bench', '--quick']))"
    )
    proc = _python(code, tmp_path)
    assert proc.returncode == 2
    assert "the benchmark needs 'psutil'" in proc.stderr
    assert "pip install -e bench/" in proc.stderr and "Traceback" not in proc.stderr
