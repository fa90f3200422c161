"""The ``bsr`` command: ``bsr bench`` (the main job), ``bsr store``, ``bsr config``, ``bsr spec``,
``bsr demo``.

Heavy imports (torch, rich, transformers) happen inside the subcommand that needs them, so
``bsr --help`` and ``bsr spec diagram`` stay fast. ``python -m bsr`` runs the same command.

Exit codes: 0 success; 1 the command worked and found a problem (``store verify`` found bad
objects, ``spec diagram --check`` found a stale diagram); 2 usage or I/O error (bad arguments,
a path that is not a bsr store); 141 (128 + SIGPIPE) stdout was closed before all was written
(``bsr store ls DIR | head -1``): the command ends quietly, with the code a shell reports for
``ls`` or ``cat`` there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import io
import json
import os
import select
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_DIAGRAM = "spec/request_lifecycle.mmd"
#: exit code when stdout's reader went away (128 + SIGPIPE, as a shell reports for ls or cat)
EXIT_CLOSED_STDOUT = 141


BENCH_MISSING = (
    "bsr bench: error: the benchmark is not installed. It is the bsr-bench package in the "
    "bench/ directory of a bsr checkout: run `make bench` there, or `pip install -e bench/` "
    "from the checkout's root (see bench/README.md)."
)


def _cmd_router(ns: argparse.Namespace) -> int:
    """Hand the arguments to :mod:`bsr.router` (``python -m bsr.router`` is the same)."""
    from .router.__main__ import main as router_main

    return router_main(list(ns.router_args), prog="bsr router")


def _cmd_bench(ns: argparse.Namespace) -> int:
    """Hand the arguments to the bench package (``bench/bsr_bench``), or say how to install it."""
    try:
        from bsr_bench.cli import main as bench_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "bsr_bench":
            print(BENCH_MISSING, file=sys.stderr)
        else:  # a dependency of the bench
            print(
                f"bsr bench: error: the benchmark needs {exc.name or str(exc)!r}, which is "
                "missing; reinstall it with `pip install -e bench/` from the checkout's root",
                file=sys.stderr,
            )
        return 2
    return bench_main(ns.bench_args, prog="bsr bench")


def _cmd_spec_diagram(ns: argparse.Namespace) -> int:
    from .core._lifecycle import mermaid

    text = mermaid()
    if ns.write:
        out = Path(ns.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        current = out.read_text("utf-8") if out.is_file() else None
        if current == text:
            print(f"{out} is up to date")
        else:
            out.write_text(text, "utf-8")
            print(f"wrote {out}")
    elif ns.check:
        out = Path(ns.output)
        if not out.is_file() or out.read_text("utf-8") != text:
            print(
                f"{out} differs from the spec table; run `bsr spec diagram --write`",
                file=sys.stderr,
            )
            return 1
        print(f"{out} matches the spec table")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_demo(ns: argparse.Namespace) -> int:
    import anyio

    from ._errors import BsrError

    try:
        anyio.run(_demo, ns.tokens, ns.window)
    except BsrError as exc:
        print(f"bsr demo: error: {exc}", file=sys.stderr)
        return 2
    return 0


async def _demo(num_tokens: int, window: int) -> None:
    """Save a Llama-3-8B-shaped KV state, evict it, probe it, restore it both ways."""
    import logging
    import tempfile

    import numpy as np
    import structlog
    import torch

    import bsr

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    layout = bsr.kv_layout(num_layers=32, num_kv_heads=8, head_dim=128)
    n = num_tokens // layout.chunk_tokens * layout.chunk_tokens
    if n == 0:
        raise bsr.ConfigError(f"--tokens must be at least one chunk ({layout.chunk_tokens})")
    tokens = np.random.default_rng(0).integers(0, 128_000, size=n)
    blocks = np.arange(n // 16)
    src = bsr.PagedKVCache(layout, num_blocks=len(blocks), block_tokens=16)
    src.tensor("kv").view(torch.int64).random_(generator=torch.Generator().manual_seed(0))
    mib = 1 << 20
    print(
        f"layout: llama3-8b KV, {layout.token_bytes} B/token, chunk {layout.chunk_bytes / mib:.0f}"
        f" MiB; state of {n} tokens = {n * layout.token_bytes / mib:.0f} MiB; W={window}"
    )
    with tempfile.TemporaryDirectory(prefix="bsr-demo-") as d:
        tier = bsr.FileTier(d, capacity_bytes=4 * n * layout.token_bytes + (64 << 20))
        engine = bsr.RestoreEngine(
            layout,
            [tier],
            window=window,
            io_depth=min(4, window),
            namespace=bsr.Namespace(model_id="demo/llama3-8b"),
        )
        async with engine:
            saved = await engine.save(tokens, src, blocks)
            print(
                f"save:    {saved.chunks} chunks in {saved.duration_s:.2f} s "
                f"(staging peak {saved.rws_peak_bytes / mib:.0f} MiB)"
            )
            probe = await engine.lookup(tokens)
            print(
                f"probe:   {probe.prefix_tokens} of {probe.num_tokens} tokens reusable, "
                f"{probe.duration_s * 1e3:.2f} ms, no data moved"
            )
            for strategy in ("bounded", "whole_plan"):
                dst = bsr.PagedKVCache(layout, num_blocks=len(blocks), block_tokens=16)
                r = await engine.restore(tokens, dst, blocks, strategy=strategy)
                same = torch.equal(dst.tensor("kv"), src.tensor("kv"))
                print(
                    f"restore ({strategy}): {r.state} {r.committed_tokens} tokens in "
                    f"{r.timings.total_s:.2f} s, RWS {r.rws_peak_bytes / mib:.0f} MiB, "
                    f"bytes identical: {same}"
                )
                del dst
            miss = await engine.lookup(np.arange(n))
            print(f"probe of other tokens: {miss.prefix_tokens} tokens reusable (a miss)")


# --------------------------------------------------------------------- bsr store
def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _emit_json(obj: Any) -> None:
    print(json.dumps(_jsonable(obj), indent=2, sort_keys=True))


def _store_stats(ns: argparse.Namespace) -> int:
    from .tiers.file import store_stats

    st = store_stats(ns.path)
    if ns.json:
        _emit_json(st)
        return 0
    print(f"store      {st.root}")
    print(
        f"objects    {st.objects} ({_human(st.bytes)} on disk, {_human(st.payload_bytes)} payload)"
    )
    print(f"quarantine {st.quarantined} files ({_human(st.quarantined_bytes)})")
    if st.temp_files:
        print(f"temp files {st.temp_files} (writes in progress, or left by a dead writer)")
    if st.unreadable:
        print(f"unreadable {st.unreadable} objects whose header cannot be parsed (run verify)")
    if st.junk:
        print(f"junk       {st.junk} entries bsr did not write (left alone: never read or moved)")
    if st.namespaces:
        print("per namespace (fingerprint of model, rank, tenant salt, layout, format version):")
        for n in st.namespaces:
            groups = ", ".join(f"{g}: {c}" for g, c in n.groups.items())
            print(
                f"  {n.namespace}  {n.objects} objects, {_human(n.bytes)}, "
                f"chunks 0..{n.max_chunk_index}, groups {{{groups}}}"
            )
    return 0


def _store_ls(ns: argparse.Namespace) -> int:
    from .tiers.file import list_objects

    objs = list_objects(ns.path)
    if ns.json:
        _emit_json(objs)
        return 0
    for o in objs:
        ns_hex = (o.namespace or "?")[:16]
        print(
            f"{o.object_id}  {o.size:>12}  {_when(o.mtime)}  ns={ns_hex}  group={o.group or '?'}"
            f"  chunk={'?' if o.chunk_index is None else o.chunk_index}"
        )
    return 0


def _progress(total: int) -> Any:
    """A rich progress bar on a TTY (stderr), else nothing; returns (callback, stop)."""
    if not sys.stderr.isatty():
        return None, lambda: None
    try:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
    except ModuleNotFoundError:
        return None, lambda: None
    columns = (
        TextColumn("verify"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[name]}"),
    )
    bar = Progress(*columns, transient=True)
    bar.start()
    task = bar.add_task("verify", total=total, name="")
    return (lambda o: bar.update(task, advance=o.size, name=o.object_id[:12])), bar.stop


#: ``check_object``'s reason for an intact object of another format version (or flags): written
#: by an older or newer bsr, not damaged; its keys are not this version's, so it is a miss
OTHER_FORMAT = "foreign"


def _store_verify(ns: argparse.Namespace) -> int:
    """Scrub the store read-only, then (``--quarantine``) move only the damaged objects: an
    object of another format version is reported as such, never as bad, and never moved."""
    from .tiers.file import list_objects, verify_store

    objs = list_objects(ns.path)
    advance, stop = _progress(sum(o.size for o in objs))
    try:
        report = verify_store(ns.path, progress=advance, objects=objs)
    finally:
        stop()
    other = [b for b in report.bad if b.reason == OTHER_FORMAT]
    bad = [b for b in report.bad if b.reason != OTHER_FORMAT]
    gone = report.gone
    if ns.quarantine and bad:
        # checked again under the root's lock before each move (re-saved meanwhile: left alone)
        by_id = {o.object_id: o for o in objs}
        moved = verify_store(ns.path, quarantine=True, objects=[by_id[b.object_id] for b in bad])
        bad, gone = moved.bad, gone + moved.gone
    if ns.json:
        _emit_json(
            {
                "checked": report.checked,
                "bytes": report.bytes,
                "bad": bad,
                "other_format": other,
                "gone": gone,
            }
        )
    else:
        for b in bad:
            moved_to = f" -> {b.quarantined_to}" if b.quarantined_to else ""
            print(f"BAD {b.object_id} {b.reason}: {b.detail}{moved_to}")
        for b in other:
            print(f"OTHER FORMAT {b.object_id}: {b.detail} (a miss for this bsr; left in place)")
        verdict = "clean" if not bad else f"{len(bad)} bad"
        hint = "" if not bad or ns.quarantine else " (rerun with --quarantine to move them)"
        formats = (
            f"; {len(other)} of another format version (not bad: a miss for this bsr, left in "
            "place; `bsr store gc` removes objects oldest first)"
            if other
            else ""
        )
        vanished = (
            f"; {gone} vanished meanwhile (evicted or re-saved by a running engine: not bad)"
            if gone
            else ""
        )
        print(
            f"verified {report.checked} objects ({_human(report.bytes)}): "
            f"{verdict}{hint}{formats}{vanished}"
        )
    return 1 if bad else 0


def _store_gc(ns: argparse.Namespace) -> int:
    from ._check import byte_size
    from .tiers.file import gc_store

    limit = 0 if ns.max_bytes.strip() == "0" else byte_size(ns.max_bytes, "--budget (--max-bytes)")
    report = gc_store(ns.path, limit, dry_run=ns.dry_run, tmp_age_s=ns.tmp_age)
    if ns.json:
        _emit_json(report)
        return 0
    verb = "would remove" if ns.dry_run else "removed"
    print(
        f"{verb} {len(report.removed)} objects ({_human(report.freed_bytes)}), oldest first; "
        f"{report.remaining_objects} objects ({_human(report.remaining_bytes)}) remain"
        + (f"; {verb} {report.removed_temps} temp files of dead writers" if report.network else "")
    )
    if report.vanished:
        print(
            f"{report.vanished} objects listed were gone when gc reached them: nodes evicted "
            "them meanwhile, or this client's directory listing is stale (sshfs caches it for "
            "20 s, NFS its attributes): run gc where listings are fresh (on the server, sshfs "
            "-o cache=no, NFS lookupcache=none,actimeo=0)"
        )
    return 0


def _store_quarantine(ns: argparse.Namespace) -> int:
    from .tiers.file import list_quarantine, purge_quarantine

    if ns.action == "list":
        files = list_quarantine(ns.path)
        if ns.json:
            _emit_json(files)
            return 0
        for q in files:
            print(f"{q.object_id}  {q.reason:<12}  {q.size:>12}  {_when(q.mtime)}  {q.path.name}")
        print(f"{len(files)} quarantined files ({_human(sum(q.size for q in files))})")
        return 0
    files = purge_quarantine(ns.path, dry_run=ns.dry_run)
    verb = "would delete" if ns.dry_run else "deleted"
    print(f"{verb} {len(files)} quarantined files ({_human(sum(q.size for q in files))})")
    return 0


def _store_command(func: Any, *, whole: bool = False) -> Any:
    """Run a store subcommand; bsr errors and OS errors become exit code 2 with a message.

    Several PATHs (the roots of a striped tier): ``whole`` commands (gc) take them together;
    the others run root by root, each headed by its path (with ``--json``: one document,
    ``{"roots": [{"path": ..., "result": ...}]}``), and exit with the worst code.
    """

    def one(ns: argparse.Namespace) -> int:
        from ._errors import BsrError

        try:
            code: int = func(ns)
        except (BsrError, OSError) as exc:
            if isinstance(exc, BrokenPipeError) and _stdout_closed():
                raise  # the reader of the listing went away: main ends quietly
            print(f"bsr store: error: {exc}", file=sys.stderr)
            return 2
        return code

    def run(ns: argparse.Namespace) -> int:
        paths = ns.path if isinstance(ns.path, list) else [ns.path]
        if whole or len(paths) == 1:
            return one(argparse.Namespace(**{**vars(ns), "path": paths if whole else paths[0]}))
        codes, docs = [], []
        for p in paths:
            each = argparse.Namespace(**{**vars(ns), "path": p})
            if getattr(ns, "json", False):
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    codes.append(one(each))
                text = out.getvalue().strip()
                docs.append({"path": p, "result": json.loads(text) if text else None})
            else:
                print(f"== {p}")
                codes.append(one(each))
        if docs:
            print(json.dumps({"roots": docs}, indent=2, sort_keys=True))
        return max(codes)

    return run


def _add_store(sub: Any) -> None:
    store = sub.add_parser(
        "store",
        help="inspect, verify and clean a FileTier directory",
        description="Administer a FileTier directory, also while engines have it open. stats, "
        "ls, verify and 'quarantine list' only read; gc and 'verify --quarantine' change "
        "objects/ under the root's lock, as the engines do, so their capacity accounting stays "
        "exact (removed objects are misses to them); 'quarantine purge' deletes only the "
        "quarantine's own files. Nothing that is not bsr's (symlinks, foreign files, FIFOs) is "
        "ever followed, moved or deleted. Exit codes: 0 ok, 1 verify found bad objects, 2 "
        "usage or I/O error (e.g. not a bsr store).",
    )
    ssub = store.add_subparsers(dest="store_command", metavar="STORE_COMMAND")

    def cmd(name: str, help: str, func: Any, *, whole: bool = False) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = ssub.add_parser(name, help=help, description=help)
        p.add_argument(
            "path",
            metavar="PATH",
            nargs="+",
            help="the FileTier directory (several: the roots of a StripedFileTier)",
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of text")
        p.set_defaults(func=_store_command(func, whole=whole))
        return p

    cmd("stats", "objects and bytes, in total and per namespace", _store_stats)
    cmd("ls", "list objects, oldest first (the LRU order)", _store_ls)
    verify = cmd(
        "verify",
        "checksum-scrub every object; exit 1 if any is bad (progress bar on a TTY)",
        _store_verify,
    )
    verify.add_argument(
        "--quarantine",
        action="store_true",
        help="move damaged objects to quarantine/ (objects of another format version stay)",
    )
    gc = cmd(
        "gc",
        "delete least recently modified objects down to --budget; on a root shared in network "
        "mode (no lock: safe beside live nodes) also temp files older than --tmp-age; over "
        "several PATHs (a striped tier's roots) the budget holds for them together",
        _store_gc,
        whole=True,
    )
    gc.add_argument(
        "--budget",
        "--max-bytes",
        dest="max_bytes",
        required=True,
        metavar="N",
        help="bytes to keep, e.g. 500GiB or 1000000 (--max-bytes: the same)",
    )
    gc.add_argument(
        "--tmp-age",
        type=float,
        default=600.0,
        metavar="S",
        help="network roots: temp files older than S seconds are a dead writer's (default 600)",
    )
    gc.add_argument("--dry-run", action="store_true", help="only report what would go")
    q = ssub.add_parser("quarantine", help="list or purge quarantine/")
    q.add_argument("action", choices=("list", "purge"))
    q.add_argument("path", metavar="PATH", nargs="+", help="the FileTier directory (or several)")
    q.add_argument("--json", action="store_true", help="print JSON instead of text (list)")
    q.add_argument("--dry-run", action="store_true", help="purge: only report")
    q.set_defaults(func=_store_command(_store_quarantine))
    store.set_defaults(func=lambda ns: _missing(store))


# --------------------------------------------------------------------- bsr config
@dataclasses.dataclass(frozen=True)
class RootFinding:
    """A file tier's root in a config, as ``bsr config check`` finds it on this machine.

    ``kind``: ``"create"`` (it does not exist: FileTier makes it, and ``missing``'s other
    folders, when the engine opens; a note), ``"not_a_directory"`` (it, or ``blocker`` above it,
    is not a directory: FileTier cannot open it) or ``"not_writable"`` (``blocker`` is not
    writable by this user: FileTier cannot write there, or cannot create it); the last two are
    errors. A root that is a writable directory has no finding.
    """

    #: the config key: ``tiers[1].path``, or ``tiers[0].paths[1]`` of a striped tier
    key: str
    #: the root, absolute (a relative one is relative to the directory the check ran in)
    path: Path
    kind: str
    #: the folders that do not exist, outermost first (the root last)
    missing: tuple[Path, ...] = ()
    #: the path that stops FileTier (the root itself, or the nearest existing folder above it)
    blocker: Path | None = None

    @property
    def error(self) -> bool:
        return self.kind != "create"

    def message(self) -> str:
        """One line: the key, what is there and what to do."""
        head = f"{self.key}: {self.path}"
        if self.kind == "create":
            parents = ", ".join(str(m) for m in self.missing[:-1])
            also = f" and its missing parents {parents}" if parents else ""
            return f"{head} does not exist; FileTier creates it{also} when the engine opens"
        if self.kind == "not_a_directory":
            if self.blocker == self.path:
                return (
                    f"{head} is not a directory; give FileTier a directory, or a path not yet there"
                )
            return f"{head} cannot be created: {self.blocker} is not a directory; choose another"
        uid = f" (uid {os.getuid()})" if hasattr(os, "getuid") else ""
        if self.blocker == self.path:
            return (
                f"{head} is not writable by this user{uid}; FileTier writes its objects there: "
                "fix its permissions or run the engine as its owner"
            )
        return (
            f"{head} does not exist and this user{uid} cannot create it: {self.blocker} is not "
            f"writable; create {self.missing[0]} for the engine's user, or choose another path"
        )


def root_findings(config: Any) -> list[RootFinding]:
    """What stands out about each file tier root of ``config`` (an EngineConfig) on this
    machine: roots that FileTier will create, and roots it cannot use. Nothing is created."""
    from .tiers.file import FileTierOptions, StripedFileTierOptions

    roots: list[tuple[str, Any]] = []
    for i, tier in enumerate(config.tiers):
        if isinstance(tier, StripedFileTierOptions):
            roots += [(f"tiers[{i}].paths[{j}]", p) for j, p in enumerate(tier.paths)]
        elif isinstance(tier, FileTierOptions):
            roots.append((f"tiers[{i}].path", tier.path))
    found = (_root_finding(key, Path(os.path.abspath(p))) for key, p in roots)
    return [f for f in found if f is not None]


def _root_finding(key: str, path: Path) -> RootFinding | None:
    missing: list[Path] = []
    here = path
    while not os.path.lexists(here) and here != here.parent:
        missing.insert(0, here)
        here = here.parent
    if not here.is_dir():  # a file, or a link to none
        return RootFinding(key, path, "not_a_directory", tuple(missing), here)
    if not os.access(here, os.W_OK | os.X_OK):
        return RootFinding(key, path, "not_writable", tuple(missing), here)
    return RootFinding(key, path, "create", tuple(missing)) if missing else None


def _cmd_config_check(ns: argparse.Namespace) -> int:
    """Parse a config (TOML file, or the environment) with EngineConfig and print it normalised;
    say which file tier roots FileTier will create, and refuse roots it cannot use."""
    from ._errors import ConfigError
    from .engine._config import EngineConfig

    try:
        if ns.path is not None:
            config = EngineConfig.from_toml(ns.path)
        else:
            config = EngineConfig.from_env(prefix=ns.prefix, strict=ns.strict)
    except ConfigError as exc:
        print(f"bsr config: error: {exc.message}", file=sys.stderr)
        return 2
    findings = root_findings(config)
    for f in findings:
        print(f"bsr config: {'error' if f.error else 'note'}: {f.message()}", file=sys.stderr)
    if any(f.error for f in findings):
        return 2
    print(json.dumps(config.to_dict(), indent=2))
    return 0


def _add_config(sub: Any) -> None:
    config = sub.add_parser(
        "config",
        help="validate an engine config (TOML file or BSR_* environment)",
        description="Parse an engine config with bsr.EngineConfig (the parser the engine and the "
        "vLLM connector use) and print it normalised as JSON (sizes in bytes, defaults filled "
        "in). Exit 2 with the offending key if it is invalid. A file tier's root that does not "
        "exist gets a note on stderr (FileTier creates it, with its parents, when the engine "
        "opens); one that is not a directory, or that this user cannot write or create, is "
        "refused (exit 2).",
    )
    csub = config.add_subparsers(dest="config_command", metavar="CONFIG_COMMAND")
    check = csub.add_parser("check", help="validate and print a config")
    check.add_argument(
        "path", nargs="?", help="TOML file ([bsr] table or top level); default: the environment"
    )
    check.add_argument("--prefix", default="BSR_", help="environment prefix (default BSR_)")
    check.add_argument(
        "--strict", action="store_true", help="reject unknown variables with the prefix"
    )
    check.set_defaults(func=_cmd_config_check)
    config.set_defaults(func=lambda ns: _missing(config))


class _VersionAction(argparse.Action):
    """``--version``: the installed distribution's version, read only when asked for (the
    metadata lookup stays out of every other command)."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kw: Any) -> None:
        from . import __version__

        print(f"bsr {__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bsr",
        description="Bounded-State Restoration: restore evicted KV-cache state through a bounded "
        "staging window.",
    )
    parser.add_argument(
        "--version", action=_VersionAction, help="print bsr's installed version and exit"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    # the bench parses its own flags (`bsr bench --help` lists them): every argument after
    # `bench` is handed over as it is (no prefix character, so no string is an option here),
    # and nothing of the bench is imported unless `bsr bench` runs
    bench = sub.add_parser(
        "bench",
        help="benchmark BSR restore vs whole-plan restore, raw reads and recompute",
        prefix_chars="\0",
        add_help=False,
    )
    bench.add_argument("bench_args", nargs="*", help=argparse.SUPPRESS)
    bench.set_defaults(func=_cmd_bench)

    # the reference router parses its own flags too (`bsr router --help`; bsr.router)
    router = sub.add_parser(
        "router",
        help="a router for a fleet of vLLM instances (KV events) or a prefill/decode split",
        prefix_chars="\0",
        add_help=False,
    )
    router.add_argument("router_args", nargs="*", help=argparse.SUPPRESS)
    router.set_defaults(func=_cmd_router)

    spec = sub.add_parser("spec", help="the formal request lifecycle")
    spec_sub = spec.add_subparsers(dest="spec_command", metavar="SPEC_COMMAND")
    diagram = spec_sub.add_parser(
        "diagram", help="print the mermaid state diagram generated from the lifecycle table"
    )
    mode = diagram.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write it to --output")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 unless --output matches the table"
    )
    diagram.add_argument(
        "--output",
        default=DEFAULT_DIAGRAM,
        help=f"file for --write/--check (default {DEFAULT_DIAGRAM})",
    )
    diagram.set_defaults(func=_cmd_spec_diagram)
    spec.set_defaults(func=lambda ns: _missing(spec))

    _add_store(sub)
    _add_config(sub)

    demo = sub.add_parser("demo", help="a short save / probe / restore demo in a temp directory")
    demo.add_argument("--tokens", type=int, default=4096, help="tokens to save and restore")
    demo.add_argument("--window", "-W", type=int, default=4, help="staging slots W")
    demo.set_defaults(func=_cmd_demo)
    return parser


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _stdout_closed() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll says POLLERR or POLLHUP);
    False where that cannot be told (stdout not a file descriptor, no poll)."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):
        return False
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in events)


def _end_quietly() -> int:
    """stdout's reader went away: point stdout at /dev/null, so that what is still buffered
    cannot fail again at exit (the recipe of Python's signal docs), and say nothing."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_CLOSED_STDOUT


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if getattr(ns, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    code: int = ns.func(ns)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``bsr``. A closed stdout (``bsr store ls DIR | head -1``, any command)
    ends it quietly with :data:`EXIT_CLOSED_STDOUT`, not a traceback or an error."""
    try:
        try:
            code = _run(argv)
        except SystemExit:  # --help, --version, a usage error: flushed here, not at exit
            sys.stdout.flush()
            raise
        sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return _end_quietly()
    return code


if __name__ == "__main__":
    sys.exit(main())
