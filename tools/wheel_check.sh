#!/usr/bin/env bash
# The release check of `make test` (make wheel-check): build bsr's sdist and wheel as a user's
# `pip install` would get them, install the wheel into a fresh virtual environment (no editable
# install, no source tree on sys.path) and use it there: `bsr --help`, `bsr --version`, `bsr config
# check` on docs/configuration.md's example config, and a save / restore through a FileTier.
#
# Usage: tools/wheel_check.sh PYTHON [TORCH_REQUIREMENT]
#   PYTHON: the interpreter with `build` installed (.venv/bin/python);
#   TORCH_REQUIREMENT: installed into the fresh environment first (default torch==2.13.0, the CPU
#   build from the local wheels; pip's cache is reused, so a second run does not unpack it again).
set -euo pipefail
PY=${1:?usage: tools/wheel_check.sh PYTHON [TORCH_REQUIREMENT]}
TORCH=${2:-torch==2.13.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bsr-wheel-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { printf '\n--- wheel check: %s\n' "$*"; }

say "build the sdist, then the wheel from the sdist (python -m build)"
"$PY" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || {
    cat "$WORK/build.log"; exit 1; }
tail -n 1 "$WORK/build.log"
# the distribution's name (bsr-kv; the import name is bsr) as file names spell it, and its version
read -r DIST VERSION < <("$PY" - "$ROOT/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(re.sub(r"[-_.]+", "_", project["name"]).lower(), project["version"])
EOF
)
WHEEL="$WORK/dist/$DIST-$VERSION-py3-none-any.whl"
SDIST="$WORK/dist/$DIST-$VERSION.tar.gz"
test -f "$WHEEL" && test -f "$SDIST" || { ls -l "$WORK/dist"; echo "expected $WHEEL and $SDIST"; exit 1; }

say "the wheel holds the package bsr and only its own files (tools/wheel_contents.py)"
"$PY" "$ROOT/tools/wheel_contents.py" check "$WHEEL" "$ROOT/src/bsr"
say "a wheel built from a tree with stray files under src/bsr leaves them out"
"$PY" "$ROOT/tools/wheel_contents.py" strays "$ROOT"

say "a fresh virtual environment: $TORCH, then the wheel"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check "$TORCH"
"$VPY" -m pip install -q --disable-pip-version-check "$TORCH" "$WHEEL"

# run from an empty directory, so nothing of the checkout can be imported
mkdir "$WORK/run"
cd "$WORK/run"
say "bsr --help / --version"
"$WORK/venv/bin/bsr" --help >/dev/null
GOT=$("$WORK/venv/bin/bsr" --version)
echo "$GOT"
test "$GOT" = "bsr $VERSION" || { echo "bsr --version said '$GOT', expected 'bsr $VERSION'"; exit 1; }
"$VPY" -c "import bsr, sys; assert bsr.__file__.startswith(sys.prefix), bsr.__file__; print(bsr.__file__)"

say "bsr config check on docs/configuration.md's example config"
# the first TOML block of docs/configuration.md, with the store in this directory
"$VPY" - "$ROOT/docs/configuration.md" <<'EOF' >bsr.toml
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
assert 'path = "/nvme/bsr"' in block, "the docs' example changed: update tools/wheel_check.sh"
print(block.replace('"/nvme/bsr"', '"store"'), end="")
EOF
"$WORK/venv/bin/bsr" config check bsr.toml

say "save and restore through the installed wheel"
"$VPY" - <<'EOF'
import anyio
import torch

import bsr

config = bsr.EngineConfig.from_toml("bsr.toml")
layout = bsr.StateLayout(chunk_tokens=16, groups=(
    bsr.StateGroup("kv", num_layers=2, token_bytes=64),
    bsr.StateGroup("swa", num_layers=1, token_bytes=32, window_tokens=32),
))
tokens = list(range(100, 164))  # four chunks


async def main() -> None:
    src = bsr.PagedKVCache(layout, num_blocks=8, block_tokens=16)
    for g in ("kv", "swa"):
        src.tensor(g).copy_(torch.randint(0, 256, src.tensor(g).shape, dtype=torch.uint8))
    async with bsr.RestoreEngine.from_config(config, layout=layout) as engine:
        saved = await engine.save(tokens, src, [0, 1, 2, 3])
        assert saved.ok and saved.saved_tokens == 64, saved
    # a second engine over the same file tier: the host tier is empty, the file tier holds it
    dst = bsr.PagedKVCache(layout, num_blocks=8, block_tokens=16)
    async with bsr.RestoreEngine.from_config(config, layout=layout) as engine:
        r = await engine.restore(tokens, dst, [4, 5, 6, 7])
    assert r.committed and r.committed_tokens == 64, r
    assert r.bytes_by_tier.get("file", 0) > 0, r.bytes_by_tier
    assert torch.equal(dst.tensor("kv")[:, 4:8], src.tensor("kv")[:, 0:4])
    last = dst.tensor("swa")[:, 6:8]  # the window group holds its last 32 tokens
    assert torch.equal(last, src.tensor("swa")[:, 2:4])
    print(f"restored {r.committed_tokens} tokens ({sum(r.bytes_by_tier.values())} bytes) "
          f"through bsr {bsr.__version__}")


anyio.run(main)
EOF
say "ok: bsr $VERSION installs from its wheel and works"
