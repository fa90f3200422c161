"""A LoRA request's KV is keyed by the weights vLLM's worker loaded, on vLLM's CPU engine
(float32, a random Llama and random adapters written by transformers and safetensors), and the
scheduler never touches an adapter's files.

* The adapter's files rewritten with other weights of the same shapes (same sizes), their
  mtimes restored (``cp -p``, a checkout, an image layer): a fresh server gets no hit of the
  old weights' KV and the tokens of a run without any connector. The same weights from another
  path (another id) still hit: the key is the content.
* The files rewritten in place while a server runs (vLLM keeps computing with what it loaded):
  what that server saves afterwards is keyed by the loaded weights, so a fresh server with the
  new files gets no hit, and one with the old weights does.
* The adapter's directory on a mount that stops answering, beside a running decode: a request
  under that adapter (loaded before the mount hung) stalls the decode no more than it does
  without any connector. Before: the scheduler stat'ed every file of the adapter inside vLLM's
  scheduler loop, and the decode waited for the mount.

Before, the first two got 192 cached tokens of the other weights' KV (the key was the name,
path, sizes and mtimes), and the third a stall as long as the hang.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_connector.hung_mount import HungMount, MountRefused
from vllm_engines import file_store_connector, run, store_objects, toks, write_llama, write_lora

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(1800)

CHUNK = 64
HIT = 192  # every full chunk of a 200-token prompt
P, P1, P2 = toks(200, 801), toks(200, 802), toks(200, 803)
LLM_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("adapters")
    write_llama(tmp / "model")
    write_lora(tmp / "w1", seed=1)
    write_lora(tmp / "w2", seed=2)
    return tmp


def engine(assets: Path, name: str, **spec: Any) -> dict[str, Any]:
    spec.setdefault("batches", [])
    return run(
        assets, name, dtype="float32", max_tokens=8, llm_args=LLM_ARGS, prefix_caching=False,
        **spec,
    )  # fmt: skip


def connector(store: Path) -> dict[str, Any]:
    return file_store_connector(store, chunk=CHUNK, model_id="adapters-llama")


def lora(path: Path, name: str = "a", lora_id: int = 1) -> list[Any]:
    return [name, lora_id, str(path)]


@pytest.fixture(scope="module")
def reference(assets: Path) -> dict[tuple[str, str], list[int]]:
    """The tokens of a run without any connector: each prompt under each weight set."""
    items = [
        {"prompt": p, "lora": lora(assets / w, w, i)}
        for w, i in (("w1", 1), ("w2", 2))
        for p in (P, P1, P2)
    ]
    out = engine(assets, "reference", generate=items)["generated"]
    names = [(w, p) for w in ("w1", "w2") for p in ("P", "P1", "P2")]
    ref = dict(zip(names, out))
    assert all(ref[("w1", p)] != ref[("w2", p)] for p in ("P", "P1", "P2"))  # the control
    return ref


def rewrite_keeping_sizes_and_times(src: Path, dst: Path) -> None:
    """``dst``'s files take ``src``'s bytes in place; sizes equal, mtimes as they were."""
    for f in sorted(src.iterdir()):
        target = dst / f.name
        st = target.stat()
        shutil.copyfile(f, target)
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
        after = target.stat()
        assert (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_other_weights_with_the_same_sizes_and_mtimes_never_share(
    assets: Path, reference: dict[tuple[str, str], list[int]]
) -> None:
    adapter, store = assets / "adapter-same-stat", assets / "store-same-stat"
    shutil.copytree(assets / "w1", adapter)
    a = lora(adapter)
    stored = engine(
        assets, "same-stat-store", connector=connector(store), add_loras=[a],
        generate=[{"prompt": P, "lora": a}], await_objects=[str(store), 3],
    )  # fmt: skip
    assert stored["generated"] == [reference[("w1", "P")]]
    rewrite_keeping_sizes_and_times(assets / "w2", adapter)
    fresh = engine(
        assets, "same-stat-fresh", connector=connector(store), add_loras=[a],
        generate=[{"prompt": P, "lora": a}],
    )  # fmt: skip
    assert fresh["generated_cached"] == [0]
    assert fresh["generated"] == [reference[("w2", "P")]]
    # the control: the stored weights, a fresh server, another path, name and id: every full
    # chunk (the key is the content)
    elsewhere = lora(assets / "w1", "other-name", 5)
    again = engine(
        assets, "same-stat-again", connector=connector(store), add_loras=[elsewhere],
        generate=[{"prompt": P, "lora": elsewhere}],
    )  # fmt: skip
    assert (again["generated_cached"], again["generated"]) == ([HIT], [reference[("w1", "P")]])


def test_files_rewritten_under_a_running_server_never_key_its_kv(
    assets: Path, reference: dict[tuple[str, str], list[int]]
) -> None:
    adapter, store = assets / "adapter-live", assets / "store-live"
    shutil.copytree(assets / "w1", adapter)
    a = lora(adapter)
    live = engine(
        assets, "live", connector=connector(store), add_loras=[a],
        generate=[
            {"prompt": P1, "lora": a},
            # rewritten in place now; vLLM keeps computing with the weights it loaded
            {"prompt": P2, "lora": a, "copy": [str(assets / "w2"), str(adapter)]},
        ],
        await_objects=[str(store), 6],
    )  # fmt: skip
    assert live["generated"] == [reference[("w1", "P1")], reference[("w1", "P2")]]
    assert len(store_objects(store)) == 6  # both saved
    fresh = engine(
        assets, "live-fresh-w2", connector=connector(store), add_loras=[a],
        generate=[{"prompt": P2, "lora": a}, {"prompt": P1, "lora": a}],
    )  # fmt: skip
    assert fresh["generated_cached"] == [0, 0]
    assert fresh["generated"] == [reference[("w2", "P2")], reference[("w2", "P1")]]
    # the control: the weights that computed both, from another path: both hit
    w1 = lora(assets / "w1", "w1", 3)
    old = engine(
        assets, "live-fresh-w1", connector=connector(store), add_loras=[w1],
        generate=[{"prompt": P2, "lora": w1}, {"prompt": P1, "lora": w1}],
    )  # fmt: skip
    assert old["generated_cached"] == [HIT, HIT]
    assert old["generated"] == [reference[("w1", "P2")], reference[("w1", "P1")]]


# ---------------------------------------------------------------------- a hung adapter mount

#: how long the mount stays hung once in place (the stall the old code showed)
HANG_S = 12.0


def _decode_stall(out: dict[str, Any]) -> float:
    """The longest wait between two outputs of the running decode from the output before the
    adapter's request was added until the decode finished."""
    rows = out["rows"]
    added = rows["lora"]["added_s"]
    times = [t for t, _ in rows["decode"]["times"]]
    before = [t for t in times if t <= added]
    after = [t for t in times if t > added]
    assert before and after, rows["decode"]
    seq = [before[-1], *after]
    return max(b - a for a, b in itertools.pairwise(seq))


def _hung_run(assets: Path, name: str, connector_: dict[str, Any] | None) -> dict[str, Any]:
    """An engine with adapter ``a`` loaded from a directory on which, once the engine is up,
    a mount that never answers is put (for HANG_S); then a decode, and beside it a request
    under ``a``."""
    adapter, gate = assets / f"adapter-{name}", assets / f"gate-{name}"
    shutil.copytree(assets / "w1", adapter)
    gate.mkdir()
    a = lora(adapter)
    script = [
        {"op": "touch", "path": str(gate / "started")},
        {"op": "wait_file", "path": str(gate / "hung"), "timeout": 300},
        {"op": "add", "id": "decode", "prompt": toks(100, 811), "max_tokens": 80},
        {"op": "run", "until": ["decode"], "min_tokens": 8},
        {"op": "add", "id": "lora", "prompt": P, "max_tokens": 4, "lora": a},
        {"op": "run", "until": ["decode", "lora"], "watchdog": 300, "release": str(gate / "hold"),
         "name": "requests"},
    ]  # fmt: skip
    mount: list[HungMount] = []
    refused: list[str] = []

    def hang() -> None:
        deadline = time.monotonic() + 600
        while not (gate / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            m = HungMount(adapter)
        except MountRefused as exc:
            refused.append(str(exc))
        else:
            mount.append(m)
            m.release_after(HANG_S)
        (gate / "hung").touch()

    t = threading.Thread(target=hang, daemon=True)
    t.start()
    try:
        spec: dict[str, Any] = {"script": script, "add_loras": [a]}
        if connector_ is not None:
            spec["connector"] = connector_
        out = engine(assets, name, **spec)["script"]
    finally:
        t.join(60)
        for m in mount:
            m.release()
    if refused:
        pytest.skip(f"no hung mount on this machine: {refused[0]}")
    assert not out["notes"]["watchdog:requests"]
    assert len(out["rows"]["decode"]["tokens"]) == 80
    return dict(out)


def test_a_hung_adapter_mount_stalls_no_running_decode(assets: Path) -> None:
    base = _decode_stall(_hung_run(assets, "hung-base", None))
    with_bsr = _decode_stall(_hung_run(assets, "hung-bsr", connector(assets / "store-hung")))
    print(f"longest decode stall beside the hung adapter: {base:.3f} s without a connector, "
          f"{with_bsr:.3f} s with bsr (hang {HANG_S} s)")  # fmt: skip
    assert with_bsr < max(3 * base, base + 3.0), (base, with_bsr)
