#!/usr/bin/env bash
# Build (or reuse) the environment in which kvmem's vLLM 0.33 contract tests run: vLLM
# 0.33.0's own Python code over the vLLM CPU 0.32 venv's packages. Prints its directory on
# its last line.
#   KVMEM_VLLM33_VENV  where it lives (default ~/.cache/kvmem/vllm-0.33.0)
#   KVMEM_VLLM_VENV    the CPU 0.32 venv it overlays (built by scripts/vllm-cpu-venv.sh)
# vllm==0.33.0 is a CUDA build pinning torch 2.14, and no vllm-cpu 0.33 exists, so it cannot
# serve here; its pure-Python modules (KV cache planning, KV specs, the connector base
# class, requests) do import under the CPU torch 2.13. The overlay is a small venv whose
# site-packages holds only the vllm 0.33.0 wheel (installed without its dependencies) and a
# .pth line that adds the 0.32 venv's site-packages after it, so `import vllm` is 0.33 and
# everything else is the 0.32 venv's. Fast when complete (a marker records what it holds).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VLLM=0.33.0
BASE=$("$REPO/scripts/vllm-cpu-venv.sh" | tail -n 1)
VENV=${KVMEM_VLLM33_VENV:-$HOME/.cache/kvmem/vllm-$VLLM}
MARKER="$VENV/.kvmem-vllm-ready"

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

stamp() { echo "vllm==$VLLM over $BASE"; }

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$(stamp)" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV"
  exit 0
fi

[ -x "$VENV/bin/python" ] || python3 -m venv --without-pip "$VENV"
PY="$VENV/bin/python"
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
BASE_SITE=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# addsitedir, not a bare path: the base's own .pth files (kvmem's editable install) apply too.
echo "import site; site.addsitedir('$BASE_SITE')" >"$SITE/zz-kvmem-vllm-cpu-base.pth"
WHEELS="$VENV/wheels"
mkdir -p "$WHEELS"
ls "$WHEELS"/vllm-$VLLM-*.whl >/dev/null 2>&1 \
  || "$BASE/bin/pip" download -q --no-deps "vllm==$VLLM" -d "$WHEELS"
# The base venv's pip, installing into this venv's site-packages only.
"$BASE/bin/pip" install -q --no-deps --no-compile --upgrade --target "$SITE" \
  "$WHEELS"/vllm-$VLLM-*.whl
rm -f "$WHEELS"/vllm-$VLLM-*.whl  # 336 MB, no longer needed once unpacked
"$PY" - "$VLLM" <<'PYEOF'
import sys
import vllm
assert vllm.__version__ == sys.argv[1], (vllm.__version__, vllm.__file__)
import torch  # the base venv's CPU build
import vllm.v1.core.kv_cache_planning, vllm.v1.kv_cache_interface, vllm.v1.request  # noqa: E401
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
PYEOF
stamp >"$MARKER"
echo "$VENV"
