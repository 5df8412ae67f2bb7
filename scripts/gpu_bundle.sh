#!/usr/bin/env bash
# Build .devbundle/ (git-ignored): what the GPU check machine lacks to run all of pdcluster, carried there with the
# working tree, since that machine reaches no package registry.
#
# That machine has Python 3.12, torch (CUDA 13), triton, transformers (and so tokenizers, safetensors,
# huggingface_hub), jinja2, aiohttp, msgpack, numpy, packaging, accelerate, cuda-core, cuda-bindings, nvidia-ml-py,
# pytest (+ pytest-timeout, pytest-xdist, hypothesis). Checked against pyproject.toml's dependencies and every
# third-party import of the packages, it lacks:
#   ray       the cluster's actors: the shared tool keeps Ray's core only (~30 MB of the bundle)
#   pyzmq     the token streams between actors and proxies
#   jsonschema (+ jsonschema-specifications, referencing, rpds-py): Ray's core imports it
#   llguidance  engine/sampling/grammar.py and engine/sampling/sampling_grammar.py import it at the top: without it no engine starts,
#             so gpu_check.sh's stages 3-5 could not run (a cp39-abi3 manylinux_2_31 wheel: its platform tag is added
#             below, the shared tool names 2_28 and older only)
#   ucxx      the UCX K/V backend (kv_transfer/backends/ucx.py), CUDA 13 build: ucxx-cu13, libucxx-cu13, libucx-cu13,
#             rmm-cu13, librmm-cu13, rapids-logger. Whole, their wheels are 57 MB (libucx-cu13 42 MB: 145 MB
#             unpacked, with static libraries, perftest and each shared library three times over), which with Ray's
#             30 MB is over the 64 MiB a device run carries; trimmed as the shared tool trims Ray (no headers, static
#             libraries, CMake files or perftest; duplicate files made links) they are .devbundle/ucx-trimmed.tar.xz,
#             ~8 MB, which gpu_check.sh unpacks beside Ray. NO_UCX=1 leaves it out.
# Not carried, and why: gguf (converts the default model, which the GPU check does not use: it builds random-weight
# models there), openai and the other test extras (CI only).
#
#   bash scripts/gpu_bundle.sh        # here, once (needs the package registry); prints the bundle's size
# then gpu_check.sh installs it first thing on the GPU machine (`bash .devbundle/install.sh`, PYTHONPATH=<tmp>/site,
# and ucx-trimmed.tar.xz unpacked there); the device run carries `.devbundle` (64 MiB at most with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
# the shared tool sits in shared/ beside the main checkout (../shared) or beside a worktree's parent (../../shared)
tool=${DEVICE_BUNDLE_TOOL:-../shared/tools/device-bundle.sh}
[ -f "$tool" ] || tool=../../shared/tools/device-bundle.sh
if [ ! -f "$tool" ]; then
  echo "error: the shared bundle tool is not at $tool (set DEVICE_BUNDLE_TOOL)" >&2
  exit 2
fi
# the pins: the versions pyproject.toml asks for, as manylinux x86_64 cp312 wheels. EXTRA_WHEELS goes into the tool's
# `pip download` as words: the extra --platform lets pip take llguidance's manylinux_2_31 wheel
EXTRA_WHEELS="--platform manylinux_2_31_x86_64 llguidance==1.9.1" bash "$tool"
rm -f .devbundle/ucx-trimmed.tar.xz
if [ "${NO_UCX:-0}" != 1 ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" \
    "ucxx-cu13==0.52.*" "libucxx-cu13==0.52.*" "libucx-cu13>=1.19,<1.22" "rmm-cu13==26.10.*" \
    "librmm-cu13==26.10.*" "rapids-logger==0.3.*"
  mkdir "$tmp/x"
  for w in "$tmp"/*.whl; do (cd "$tmp/x" && python3 -m zipfile -e "$w" .); done
  # what nothing imports or loads at run time: headers, static libraries, CMake and pkg-config files, UCX's perftest
  find "$tmp/x" \( -name include -o -name cmake -o -name pkgconfig -o -name '*perftest*' \) -prune -exec rm -rf {} +
  find "$tmp/x" -name '*.a' -delete
  # a wheel holds no links: libfoo.so, libfoo.so.0 and libfoo.so.0.0.0 come as three copies; keep one, link the rest
  python3 - "$tmp/x" <<'PY'
import hashlib, os, sys
seen: dict[str, str] = {}
for root, _, files in sorted(os.walk(sys.argv[1])):
    for f in sorted(files):
        p = os.path.join(root, f)
        if os.path.islink(p):
            continue
        h = hashlib.sha256(open(p, "rb").read()).hexdigest()
        if h in seen:
            os.remove(p)
            os.symlink(os.path.relpath(seen[h], root), p)
        else:
            seen[h] = p
PY
  (cd "$tmp/x" && tar -cf - . | xz -T0 -6 > "$OLDPWD/.devbundle/ucx-trimmed.tar.xz")
  echo "ucx: $(du -h .devbundle/ucx-trimmed.tar.xz | cut -f1) (ucxx-cu13 and what it loads, trimmed)"
fi
size=$(du -sb .devbundle | cut -f1)
limit=$((64 * 1024 * 1024))
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n1 | cut -f1)
echo "bundle: $((size / 1024 / 1024)) MiB; with the tracked working tree ($((tree / 1024 / 1024)) MiB): \
$(((size + tree) / 1024 / 1024)) of the 64 MiB a device run carries"
if [ $((size + tree)) -gt "$limit" ]; then
  echo "error: the bundle and the working tree exceed the 64 MiB a device run carries" >&2
  exit 1
fi
