#!/usr/bin/env bash
# Build .devbundle/ (git-ignored): what the GPU check machine lacks to run all of pdcluster, carried there with the
# working tree, since that machine reaches no package registry.
#
# That machine has Python 3.12, torch (CUDA), triton, transformers (and so tokenizers, safetensors, huggingface_hub),
# jinja2, aiohttp, msgpack, numpy, packaging, accelerate, pytest (+ pytest-timeout, pytest-xdist, hypothesis). Checked
# against pyproject.toml's dependencies and every third-party import of the packages, it lacks:
#   ray       the cluster's actors: the shared tool keeps Ray's core only (~30 MB of the bundle)
#   pyzmq     the token streams between actors and proxies
#   jsonschema (+ jsonschema-specifications, referencing, rpds-py): Ray's core imports it
#   llguidance  engine/grammar.py and engine/sampling_grammar.py import it at the top: without it no engine starts,
#             so gpu_check.sh's stages 3-5 could not run (a cp39-abi3 manylinux_2_31 wheel: its platform tag is added
#             below, the shared tool names 2_28 and older only)
# Not carried, and why: gguf (converts the default model, which the GPU check does not use: it builds tiny random-weight
# models there), openai / jsonschema's test extras (CI only), ucxx (UCX): ucxx-cu13 0.52 needs libucx-cu13 (42 MB
# wheel, 145 MB unpacked: static libraries and perftest included), libucxx-cu13 (4.7 MB), librmm-cu13 (4.8 MB) and
# rmm-cu13 (1 MB): with Ray's 30 MB over the 64 MiB that a device run carries (docs/operations.md, "GPU check").
#
#   bash scripts/gpu_bundle.sh        # here, once (needs the package registry); prints the bundle's size
# then gpu_check.sh installs it first thing on the GPU machine (`bash .devbundle/install.sh`, PYTHONPATH=<tmp>/site);
# the device run carries `.devbundle` (64 MiB at most with the working tree).
set -euo pipefail
cd "$(dirname "$0")/.."
tool=${DEVICE_BUNDLE_TOOL:-../../shared/tools/device-bundle.sh}
[ -f "$tool" ] || tool=/work/shared/tools/device-bundle.sh
if [ ! -f "$tool" ]; then
  echo "error: the shared bundle tool is not at $tool (set DEVICE_BUNDLE_TOOL)" >&2
  exit 2
fi
# the pins: the versions pyproject.toml asks for, as manylinux x86_64 cp312 wheels. EXTRA_WHEELS goes into the tool's
# `pip download` as words: the extra --platform lets pip take llguidance's manylinux_2_31 wheel
EXTRA_WHEELS="--platform manylinux_2_31_x86_64 llguidance==1.9.1" bash "$tool"
size=$(du -sb .devbundle | cut -f1)
limit=$((64 * 1024 * 1024))
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -n1 | cut -f1)
echo "bundle: $((size / 1024 / 1024)) MiB; with the tracked working tree ($((tree / 1024 / 1024)) MiB): \
$(((size + tree) / 1024 / 1024)) of the 64 MiB a device run carries"
if [ $((size + tree)) -gt "$limit" ]; then
  echo "error: the bundle and the working tree exceed the 64 MiB a device run carries" >&2
  exit 1
fi
