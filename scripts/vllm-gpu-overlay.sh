#!/usr/bin/env bash
# Rebuild .vllmgpu/ from scratch: what a GPU machine without network needs to run vLLM
# 0.33.0's own Python code over its own torch (benchmarks/gpu/vllm_on_device.py; docs/gpu.md,
# "vLLM on the device"). git ignores the folder; it travels with the tree.
#   .vllmgpu/vllm-0.33.0-py.tar.xz   vLLM 0.33.0's wheel without its compiled code: its .py,
#                                     .json, .jinja and dist-info files (no .so, no C/CUDA
#                                     headers, no vllm-rs binary, no benchmarks)
#   .vllmgpu/kvmem-0.1.0.dist-info/  METADATA and entry_points.txt, so that vLLM finds
#                                     kvmem's vllm.general_plugins entry point when kvmem is
#                                     imported from PYTHONPATH instead of installed
#   .vllmgpu/wheels/                  vLLM's dependencies the device's Python lacks (cp312,
#                                     manylinux x86_64), one version each; the script installs
#                                     only those the device does not already have
#   .vllmgpu/MANIFEST.txt             what was built, with sizes
# Wheels already in .whl/ (fastapi, pydantic, ...) are not downloaded again.
#   VLLM_WHEEL=/path/to/vllm-0.33.0-...whl  use a downloaded wheel instead of fetching 336 MB
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT="$REPO/.vllmgpu"
VLLM=0.33.0
PYTHON=${PYTHON:-python3}
# vLLM's imports for an offline LLM of a text model that the device's Python lacks (found
# by importing vLLM 0.33's engine, worker, Llama and Triton-attention modules over only the
# device's packages, adding what each import stopped at), pinned to versions with cp312
# wheels. openai 2.x, not 3.x: 3.x needs httpx2, the device has httpx. The last five are
# aiohttp's and openai's own requirements, carried in case the device lacks them (the
# device check installs a wheel only where its distribution is absent).
WHEELS=(
  cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 cachetools==8.0.2
  openai==2.25.0 sniffio==1.3.1 jiter==0.19.0 distro==1.9.0 oss-harmony==0.0.11
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.7.6
  partial-json-parser==0.2.1.1.post7 blake3==1.0.11 setproctitle==1.3.8
  multidict==7.2.1 yarl==1.25.1 frozenlist==1.8.0 propcache==0.5.4
)
# llguidance 1.7 is built for glibc 2.31 and later only
PLATFORMS=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)

# git ignores the payloads (a clone's own exclude file, not .gitignore)
EXCLUDE="$REPO/.git/info/exclude"
mkdir -p "$(dirname "$EXCLUDE")"
touch "$EXCLUDE"
for line in /.whl/ /.vllmgpu/; do
  grep -qxF "$line" "$EXCLUDE" || echo "$line" >>"$EXCLUDE"
done

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT/wheels"

if [ -z "${VLLM_WHEEL:-}" ]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$TMP/dl" "vllm==$VLLM"
  VLLM_WHEEL=$(ls "$TMP"/dl/vllm-$VLLM-*.whl)
fi

# vLLM's Python and data files only
"$PYTHON" - "$VLLM_WHEEL" "$TMP/tree" <<'PYEOF'
import sys, zipfile
from pathlib import PurePosixPath
wheel, dest = sys.argv[1:3]
keep_suffix = {".py", ".json", ".jinja", ".typed", ".txt", ".ini"}
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if not n.endswith("/") and not n.startswith("vllm/benchmarks/")
             and (PurePosixPath(n).suffix in keep_suffix
                  or n.endswith((".dist-info/METADATA", ".dist-info/WHEEL")))]
    z.extractall(dest, names)
print(f"kept {len(names)} files of the wheel")
PYEOF
tar -C "$TMP/tree" -cJf "$OUT/vllm-$VLLM-py.tar.xz" vllm "vllm-$VLLM.dist-info"

# kvmem's entry point, read from pyproject.toml
mkdir -p "$OUT/kvmem-0.1.0.dist-info"
"$PYTHON" - "$REPO/pyproject.toml" "$OUT/kvmem-0.1.0.dist-info" <<'PYEOF'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
out = Path(sys.argv[2])
(out / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                              f"Version: {project['version']}\n")
lines = []
for group, points in project.get("entry-points", {}).items():
    lines += [f"[{group}]"] + [f"{k} = {v}" for k, v in points.items()] + [""]
(out / "entry_points.txt").write_text("\n".join(lines))
PYEOF

# dependency wheels, except those .whl/ already has
have=" "
for w in "$REPO"/.whl/*.whl; do
  [ -e "$w" ] || continue
  n=$(basename "$w" | cut -d- -f1 | tr 'A-Z-.' 'a-z__')
  have+="$n "
done
for spec in "${WHEELS[@]}"; do
  n=$(echo "${spec%%==*}" | tr 'A-Z-.' 'a-z__')
  case "$have" in *" $n "*) echo "skip $spec (in .whl/)"; continue ;; esac
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$OUT/wheels" "$spec"
done

{
  echo "vLLM $VLLM Python code for the device, built $(date -u +%Y-%m-%dT%H:%MZ)"
  (cd "$OUT" && find . -type f | sort | xargs du -b)
  echo "total bytes: $(du -sb "$OUT" | cut -f1)"
} >"$OUT/MANIFEST.txt"
cat "$OUT/MANIFEST.txt"
du -sh "$OUT" "$REPO/.whl" 2>/dev/null || true
