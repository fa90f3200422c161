"""One-shot GPU validation of bsr: install, then the CUDA tests, the bench, the paper-scale point
and HCache, each bounded in time, inside one global budget (see README.md here, docs/gpu.md).

    python3 bench/gpu/run.py --out DIR           # on a CUDA machine (9 minutes by default)
    python3 bench/gpu/run.py --dry-run           # anywhere: the same steps on the CPU, tiny sizes

How it works: the carried wheels (``--wheels``, default ``.whl/``; see wheels.py) and bsr from this
working tree are installed with pip, offline, into a scratch site (``pip install --target``); the
steps run as child processes of the running Python with that site first on ``PYTHONPATH``, so
the machine's own torch (CUDA) is used. Before each step the time left is compared with the
step's estimate: a step that does not fit is skipped with a line saying so; one that runs past
its limit is stopped (its process group) and marked ``timeout``. Everything a step prints goes
to ``run.log``; the console gets a line per step, the tail of a failing step, and a table of
figures at the end. All results go into one JSON document, ``gpu-<machine>-<time>.json``,
rewritten after every step (so a run cut short still returns what it measured): copy it to
``bench/results/``. Standard library only (the scratch site does not exist yet when this starts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: seconds kept back from the budget for writing the results
RESERVE_S = 10.0


@dataclass
class Step:
    """One step: ``estimate`` (seconds expected) and ``limit`` (the most it may take)."""

    name: str
    title: str
    estimate: float
    limit: float
    command: Callable[[Run, float], list[str]]
    output: str | None = None  # the document the step writes (in the work folder)


class Run:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.dry = ns.dry_run
        self.t0 = time.monotonic()
        self.deadline = self.t0 + ns.budget_s
        self.out = Path(ns.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="bsr-gpu-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="bsr-gpu-work-"))
        self.site = Path(ns.site) if ns.site else self.work / "site"
        self.own_state = not ns.state_dir
        self.state = Path(ns.state_dir) if ns.state_dir else self.pick_state_dir()
        self.log_path = self.out / "run.log"
        self.log_path.write_text("")
        self.device = "cpu" if self.dry else "cuda"
        self.kvikio_imports = False  # set by the environment probe
        self.doc: dict[str, Any] = {
            "schema": "bsr-gpu-run/1",
            "tool": "bench/gpu/run.py",
            "dry_run": self.dry,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv[1:],
            "commit": ns.commit or git_commit(),
            "budget_s": ns.budget_s,
            "state_dir": str(self.state),
            "steps": [],
        }
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.result_path = self.out / f"gpu-{'dry-run' if self.dry else 'run'}-{stamp}.json"

    # ------------------------------------------------------------------ plumbing
    def left(self) -> float:
        return self.deadline - time.monotonic() - RESERVE_S

    def say(self, line: str) -> None:
        print(line, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def pick_state_dir(self) -> Path:
        """A fresh folder on the largest disk-backed filesystem among the usual places (ties: the
        first; the working tree itself last)."""
        best: tuple[int, Path] | None = None
        for cand in (Path(tempfile.gettempdir()), Path("/var/tmp"), Path.home(), REPO):
            try:
                st = os.statvfs(cand)
            except OSError:
                continue
            if fstype(cand) in ("tmpfs", "ramfs") or not os.access(cand, os.W_OK):
                continue
            free = st.f_bavail * st.f_frsize
            if best is None or free > best[0]:
                best = (free, cand)
        base = best[1] if best else Path(tempfile.gettempdir())
        return Path(tempfile.mkdtemp(prefix="bsr-gpu-state-", dir=base))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if not self.ns.no_install:
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(self.site), env.get("PYTHONPATH", "")) if p
            )
        env.update(
            PYTHONUNBUFFERED="1",
            MPLBACKEND="Agg",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        if self.dry:
            env["BSR_CUDA_TESTS_ON"] = "cpu"
        else:
            env["BSR_REQUIRE_CUDA"] = "1"
            if self.kvikio and self.kvikio_imports:
                env["BSR_REQUIRE_KVIKIO"] = "1"
        return env

    @property
    def kvikio(self) -> bool:
        return not (self.ns.no_kvikio or self.ns.no_install)

    def execute(self, cmd: list[str], limit: float, env: dict[str, str]) -> tuple[int, deque[str]]:
        """Run ``cmd`` in its own process group for at most ``limit`` s; (rc, last lines).

        rc is 124 when the limit stopped it.
        """
        tail: deque[str] = deque(maxlen=60)
        with self.log_path.open("a") as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )

            def pump() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    tail.append(line.rstrip("\n"))
                log.flush()

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                rc = proc.wait(timeout=max(1.0, limit))
            except subprocess.TimeoutExpired:
                stop_group(proc)
                rc = 124
            reader.join(timeout=10)
        return rc, tail

    def save(self) -> None:
        self.doc["duration_s"] = time.monotonic() - self.t0
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(self.result_path)

    # ------------------------------------------------------------------ install + environment
    def install(self) -> bool:
        if self.ns.no_install:
            self.say("install: skipped (--no-install: the running environment is used)")
            self.doc["install"] = {"status": "skipped"}
            return True
        wheels = Path(self.ns.wheels).resolve()
        reqs = self.work / "requirements.txt"
        lines = (HERE / "requirements.txt").read_text().splitlines()
        if not self.kvikio:
            lines = [x for x in lines if "kvikio" not in x and "rapids-logger" not in x]
        reqs.write_text("\n".join(lines) + "\n")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(wheels),
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(self.site),
            "-r",
            str(reqs),
            str(REPO),
            str(REPO / "bench"),  # bsr-bench: what `bsr bench` runs
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull  # only the carried wheels, never an index
        t = time.monotonic()
        rc, tail = self.execute(cmd, min(180.0, self.left()), env)
        s = time.monotonic() - t
        self.doc["install"] = {
            "status": "ok" if rc == 0 else "failed",
            "s": s,
            "rc": rc,
            "wheels": str(wheels),
            "site": str(self.site),
            "kvikio": self.kvikio,
        }
        if rc:
            self.say(f"install: FAILED (rc {rc}) in {s:.1f} s; the last lines:")
            for line in list(tail)[-30:]:
                self.say(f"  | {line}")
            return False
        self.say(f"install: ok in {s:.1f} s ({wheels} -> {self.site})")
        return True

    def environment(self) -> bool:
        """Print and record the interpreter, torch, the GPU and where each package loads from."""
        probe = ENV_PROBE.replace("@SITE@", "" if self.ns.no_install else str(self.site))
        probe = probe.replace("@KVIKIO@", "1" if self.kvikio and not self.dry else "")
        rc, tail = self.execute([sys.executable, "-c", probe], 120.0, self.env())
        info: dict[str, Any] = {}
        for line in tail:
            if line.startswith("ENV-JSON "):
                info = json.loads(line[len("ENV-JSON ") :])
        self.doc["environment"] = info
        if rc or not info:
            self.say("environment: FAILED; the last lines:")
            for line in list(tail)[-30:]:
                self.say(f"  | {line}")
            return False
        for problem in info.get("problems", []):
            self.say(f"environment: {problem}")
        self.kvikio_imports = bool(info.get("kvikio"))
        if info.get("kvikio_error"):
            self.say(
                f"environment: kvikio does not import ({info['kvikio_error']}): its tests "
                "and figures are skipped"
            )
        self.say(
            f"environment: Python {info['python']}, torch {info['torch']} (CUDA "
            f"{info['torch_cuda']}), GPU {info.get('gpu') or 'none'}, bsr {info['bsr']} from "
            f"{info['bsr_path']}, kvikio {info.get('kvikio', 'not installed')}"
        )
        if info.get("nvidia_smi"):
            self.say(f"environment: nvidia-smi: {info['nvidia_smi']}")
        gpu = info.get("gpu")
        name = "dry-run-cpu" if self.dry else slug(gpu or "unknown-gpu")
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self.result_path.unlink(missing_ok=True)
        self.result_path = self.out / f"gpu-{name}-{stamp}.json"
        if not self.dry and not info.get("cuda_available"):
            self.say(
                "environment: torch sees no CUDA device: nothing to validate here "
                "(use --dry-run on a machine without a GPU)"
            )
            return False
        return not info.get("problems")

    # ------------------------------------------------------------------ steps
    def steps(self) -> list[Step]:
        """The steps, with (estimate, limit) in seconds for one H200 or, dry, a 2-core CPU."""
        d, py, work, dev = self.dry, sys.executable, self.work, self.device
        state = str(self.state)

        def tests(run: Run, limit: float) -> list[str]:
            args = "-m pytest -m cuda tests/gpu -q -rs -p no:cacheprovider --timeout 120"
            return [py, *args.split(), "--junitxml", str(work / "pytest.xml")]

        def bench(run: Run, limit: float) -> list[str]:
            cmd = [py, "-m", "bsr", "bench", "--device", dev, "--no-plots", "--path", state,
                   "--json", str(work / "bench.json")]  # fmt: skip
            reduced = ("--layout dsv4-flash --layout llama3-8b -W 8 --io-depth 4 --windows "
                       "2,8,16 --io-depths 1,4 --no-overhead --no-concurrency")  # fmt: skip
            size = "--quick --sizes 512,1024 --repeats 1" if d else "--sizes 4096,16384 --repeats 3"
            return [*cmd, *reduced.split(), *size.split()]

        def figures(run: Run, limit: float) -> list[str]:
            cmd = [py, str(HERE / "cuda_figures.py"), "--device", dev, "--state-dir", state,
                   "--json", str(work / "figures.json")]  # fmt: skip
            size = ("--tokens 2048 --layer-tokens 512 -W 4 --io-depth 2 --repeats 2" if d
                    else "--tokens 16384")  # fmt: skip
            return [*cmd, *size.split()]

        def paper(run: Run, limit: float) -> list[str]:
            cmd = [py, str(HERE / "paper_point.py"), "--device", dev, "--state-dir", state,
                   "--json", str(work / "paper.json"),
                   "--budget-s", f"{max(10.0, limit - 25.0):.0f}"]  # fmt: skip
            return [*cmd, "--tokens", "4096", "-W", "4"] if d else cmd

        def hcache(run: Run, limit: float) -> list[str]:
            cmd = [py, "-m", "bsr", "bench", "--hcache", "--device", dev, "--no-plots",
                   "--path", state, "--json", str(work / "hcache.json")]  # fmt: skip
            # a GPU: the paper's class of model (Llama-2-7B MHA and Llama-3-8B GQA shapes, bf16,
            # random weights made on the device), from the disk and the host tier; size by size
            # and the document written after each point, so a cut at the limit loses 16K only
            paper = ["--hcache-shape", "paper", "--sizes", "1024,4096,16384", "--repeats", "3"]
            return [*cmd, "--quick", "--sizes", "256"] if d else [*cmd, *paper]

        def step(name: str, title: str, dry: tuple[int, int], gpu: tuple[int, int],
                 command: Callable[[Run, float], list[str]], output: str) -> Step:  # fmt: skip
            return Step(name, title, *(dry if d else gpu), command, output)

        return [
            step("tests", "cuda tests (tests/gpu, -m cuda)", (25, 120), (60, 150), tests,
                 "pytest.xml"),
            step("bench", f"bsr bench --device {dev} (reduced)", (30, 120), (100, 170), bench,
                 "bench.json"),
            step("figures", "install vs pinned memcpy, kvikio vs POSIX (cuda_figures.py)",
                 (15, 90), (45, 100), figures, "figures.json"),
            step("paper", "paper point: dsv4-flash 524,288 tokens, W=32 (paper_point.py)",
                 (15, 90), (150, 280), paper, "paper.json"),
            step("hcache", f"bsr bench --hcache --device {dev}", (60, 150), (240, 330), hcache,
                 "hcache.json"),
        ]  # fmt: skip

    def run_step(self, step: Step, later: list[Step]) -> None:
        rec: dict[str, Any] = {"name": step.name, "title": step.title, "estimate_s": step.estimate}
        self.doc["steps"].append(rec)
        left = self.left()
        if step.estimate > left:
            rec["status"] = "skipped"
            self.say(
                f"[{step.name}] skipped: needs about {step.estimate:.0f} s, "
                f"{max(0.0, left):.0f} s left"
            )
            return
        # leave the later steps their estimates where that still leaves this one its own
        keep = sum(s.estimate for s in later)
        limit = min(step.limit, left - keep) if left - keep >= step.estimate else step.estimate
        limit = min(limit, left)
        cmd = step.command(self, limit)
        rec.update(limit_s=limit, command=cmd)
        self.say(f"[{step.name}] {step.title}: up to {limit:.0f} s")
        t = time.monotonic()
        rc, tail = self.execute(cmd, limit, self.env())
        rec["s"] = time.monotonic() - t
        rec["rc"] = rc
        rec["status"] = "ok" if rc == 0 else ("timeout" if rc == 124 else "failed")
        out = self.work / step.output if step.output else None
        if out is not None and out.exists():
            if out.suffix == ".json":
                rec["document"] = json.loads(out.read_text())
            else:
                rec["document"] = junit(out)
        rec["figures"] = figures_of(step.name, rec.get("document"))
        self.say(f"[{step.name}] {rec['status']} in {rec['s']:.1f} s (rc {rc})")
        if rc:
            rec["tail"] = list(tail)[-40:]
            for line in list(tail)[-25:]:
                self.say(f"  | {line}")

    def main(self) -> int:
        self.say(
            f"bsr GPU validation{' (dry run, CPU)' if self.dry else ''}: budget "
            f"{self.ns.budget_s:.0f} s, results in {self.out}, state in {self.state}"
        )
        ok = self.install() and self.environment()
        self.save()
        if not ok:
            self.say("stopping: the installation or the environment is not usable")
            return 2
        wanted = [s for s in self.steps() if s.name in self.ns.steps]
        for i, step in enumerate(wanted):
            self.run_step(step, wanted[i + 1 :])
            self.save()
        self.finish()
        self.save()
        bad = [r["name"] for r in self.doc["steps"] if r.get("status") in ("failed", "timeout")]
        return 1 if bad else 0

    def finish(self) -> None:
        summary = {r["name"]: r.get("figures", {}) for r in self.doc["steps"]}
        self.doc["summary"] = summary
        self.say("")
        self.say(f"{'step':<9}{'status':<9}{'s':>7}  figures")
        for r in self.doc["steps"]:
            figs = ", ".join(f"{k}={fmt(v)}" for k, v in r.get("figures", {}).items())
            self.say(f"{r['name']:<9}{r.get('status', '?'):<9}{r.get('s', 0):>7.1f}  {figs}")
        total = time.monotonic() - self.t0
        self.say(
            f"total {total:.0f} s of {self.ns.budget_s:.0f}; JSON: {self.result_path}; "
            f"log: {self.log_path}"
        )
        if not self.dry:
            self.say(f"commit it: cp {self.result_path.name} bench/results/")


# ---------------------------------------------------------------------- helpers
ENV_PROBE = r"""
import importlib, json, os, platform, shutil, subprocess, sys
site, want_kvikio = "@SITE@", "@KVIKIO@"
problems = []
import torch
info = {"python": platform.python_version(), "executable": sys.executable,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "cpus": os.cpu_count(),
        "platform": platform.platform()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=p.total_memory,
                gpu_count=torch.cuda.device_count(), capability=f"{p.major}.{p.minor}")
if shutil.which("nvidia-smi"):
    q = "name,memory.total,driver_version,clocks.sm,clocks.max.sm,temperature.gpu"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                       capture_output=True, text=True)
    info["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
mods = ["bsr", "transitions", "structlog", "jsonschema", "referencing", "rpds", "trio",
        "anyio", "numpy", "xxhash", "pytest", "pytest_timeout", "hypothesis", "transformers",
        "rich", "matplotlib", "psutil", "prometheus_client"]
if want_kvikio:
    try:
        import kvikio
    except Exception as exc:  # a finding, not a reason to stop: its tests and figures skip
        info["kvikio_error"] = repr(exc)
    else:
        mods.append("kvikio")
versions, paths = {}, {}
for m in mods:
    try:
        mod = importlib.import_module(m)
    except Exception as exc:
        problems.append(f"{m} does not import: {exc!r}")
        continue
    versions[m] = getattr(mod, "__version__", "?")
    paths[m] = os.path.dirname(getattr(mod, "__file__", "") or "")
    carried = m in ("bsr", "transitions", "structlog", "jsonschema", "referencing", "rpds",
                    "trio", "kvikio")
    if site and carried and not paths[m].startswith(site):
        problems.append(f"{m} loads from {paths[m]}, not from the scratch site {site}")
info.update(versions=versions, paths=paths, problems=problems)
info["bsr"], info["bsr_path"] = versions.get("bsr"), paths.get("bsr")
info["kvikio"] = versions.get("kvikio")
print("ENV-JSON " + json.dumps(info))
"""


def stop_group(proc: subprocess.Popen[str]) -> None:
    """End the process group this run started for a step: TERM, then KILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def fstype(path: Path) -> str:
    best, kind = "", "unknown"
    real = os.path.realpath(path)
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mp = parts[1]
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) > len(best):
            best, kind = mp, parts[2]
    return kind


def git_commit() -> str | None:
    try:
        r = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        return r.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def junit(path: Path) -> dict[str, Any]:
    """Counts and failures of a pytest junit XML file."""
    root = ET.parse(path).getroot()
    cases, failures = 0, []
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        cases += 1
        tid = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append({"test": tid, "message": (bad.get("message") or "")[:500]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"tests": cases, **counts, "failures": failures}


def _get(doc: Any, *path: Any) -> Any:
    for key in path:
        try:
            doc = doc[key]
        except (KeyError, IndexError, TypeError):
            return None
    return doc


def figures_of(step: str, doc: Any) -> dict[str, Any]:
    """The few numbers of a step's document the final table shows (missing ones left out)."""
    if not isinstance(doc, dict):
        return {}
    out: dict[str, Any] = {}
    if step == "tests":
        out = {k: doc[k] for k in ("passed", "failed", "skipped")}
    elif step == "bench":
        for t in doc.get("targets", []):
            if t.get("name") in (
                "rws_equals_w_x_chunk",
                "bsr_bandwidth_vs_raw",
                "bsr_ttft_vs_whole_plan",
                "restore_vs_recompute_8k",
            ):
                out[t["name"]] = t.get("value")
        verified = doc.get("verified")
        if isinstance(verified, dict):
            out["verified"] = all(verified.values())
    elif step == "figures":
        out["restore_from_host_GBps"] = _gb(_get(doc, "install", "restore_bandwidth_Bps"))
        out["pinned_h2d_GBps"] = _gb(_get(doc, "install", "h2d_bandwidth_Bps"))
        out["restore_vs_h2d"] = _get(doc, "install", "restore_vs_h2d_bandwidth")
        out["layer_restore_vs_h2d"] = _get(doc, "layer_install", "restore_vs_h2d_bandwidth")
        out["layer_restore_GBps"] = _gb(_get(doc, "layer_install", "restore_bandwidth_Bps"))
        verify = _get(doc, "install", "reference", "verify")
        if isinstance(verify, dict):  # the CPU checks' rate, on 1 and on io_depth threads
            for k, v in verify.items():
                if k.startswith("threads_"):
                    out[f"verify_{k.removesuffix('_Bps')}_GBps"] = _gb(v)
        for r in ("posix", "kvikio"):
            out[f"{r}_restore_GBps"] = _gb(_get(doc, "readers", r, "restore_bandwidth_Bps"))
            out[f"{r}_raw_GBps"] = _gb(_get(doc, "readers", r, "raw_bandwidth_Bps"))
        out["kvikio_vs_posix_restore"] = _get(doc, "readers", "kvikio_vs_posix_restore")
        out["rws_exact"] = _get(doc, "rws", "every_restore_exact")
    elif step == "paper":
        out["tokens"] = _get(doc, "config", "tokens")
        out["state_GiB"] = _get(doc, "config", "state_gib")
        for p in doc.get("points", []):
            tag = "wp" if p.get("strategy") == "whole_plan" else f"bsr_io{p.get('io_depth')}"
            out[f"{tag}_ttft_s"] = p.get("ttft_s")
            out[f"{tag}_rws_MiB"] = p.get("rws_peak_bytes", 0) / 2**20
            out[f"{tag}_ok"] = bool(p.get("verified") and p.get("rws_exact"))
            if tag == "wp":
                out["wp_host_peak_GiB"] = p.get("rss_growth_bytes", 0) / 2**30
        out["readers_speedup"] = _get(doc, "readers_row", "speedup")
    elif step == "hcache":
        for p in doc.get("results", []):
            tag = f"{p.get('model')}{p.get('tokens')}"
            r = _get(p, "recompute_s", "median")
            for k in ("kv", "hcache"):
                t = _get(p, k, "total_s", "median")
                if r and t:
                    out[f"{tag}_recompute_vs_{k}"] = r / t
            out[f"{tag}_rebuild_vs_gemm"] = p.get("rebuild_vs_gemm")
            out[f"{tag}_rebuild_grouped_vs_gemm"] = p.get("rebuild_grouped_vs_gemm")
            out[f"{tag}_planner_regret"] = p.get("planner_regret")
    return {k: v for k, v in out.items() if v is not None}


def _gb(v: Any) -> float | None:
    return None if v is None else v / 1e9


def parse(argv: list[str] | None) -> argparse.Namespace:
    names = ["tests", "bench", "figures", "paper", "hcache"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="results folder (default $OUT, else a new temporary folder)")
    p.add_argument(
        "--dry-run", action="store_true", help="no GPU needed: every step on the CPU at tiny sizes"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run (default 540; dry run 300)",
    )
    p.add_argument(
        "--steps",
        default=",".join(names),
        help=f"comma-separated subset of {','.join(names)} (default all, in order)",
    )
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="carried wheels (.whl)")
    p.add_argument("--site", help="scratch site to install into (default: a new temp folder)")
    p.add_argument("--state-dir", help="where states are written (default: the largest disk)")
    p.add_argument(
        "--no-install",
        action="store_true",
        help="use the running environment as it is (bsr-kv[test] and bsr-bench installed)",
    )
    p.add_argument("--no-kvikio", action="store_true", help="do not install the kvikio wheels")
    p.add_argument("--commit", help="the commit being validated (default: git rev-parse HEAD)")
    ns = p.parse_args(argv)
    ns.steps = [s.strip() for s in ns.steps.split(",") if s.strip()]
    unknown = set(ns.steps) - set(names)
    if unknown:
        p.error(f"unknown steps {sorted(unknown)}; choose from {names}")
    if ns.budget_s is None:
        ns.budget_s = 300.0 if ns.dry_run else 540.0
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    run = Run(ns)
    try:
        return run.main()
    finally:
        run.save()
        shutil.rmtree(run.work, ignore_errors=True)
        if run.own_state:
            shutil.rmtree(run.state, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
