#!/usr/bin/env bash
# Assemble vLLM's speculators 0.9.0 (and SpecForge 0.2.0, the other peer) for the lent GPU: the py3.12 wheels of what
# the GPU image lacks, unpacked into one site folder that a `run` call carries (~12 MiB) and puts first on PYTHONPATH.
# `bench/gpu/speculators_peer.py` documents the run.
#
#   bash bench/gpu/stage_speculators.sh        # -> .gpu-stage/spx/site  (gitignored)
#
# The image has torch 2.11, transformers 5.17, triton, safetensors, httpx, anyio, tqdm, numpy, pyarrow, pandas,
# fsspec, xxhash, huggingface-hub. speculators' model modules import `openai` and `datasets` (its training data
# module, imported by the EAGLE-3 package) and pydantic (its configs); everything goes in with no dependency
# resolution: speculators declares transformers <= 5.19 and torch <= 2.14.1, which the image satisfies.
# SpecForge is copied from this venv (`pip install --no-deps -r .ci/specforge-requirements.txt`), as
# `python -m bench.gpu.specforge_accept --stage` does. Idempotent: wheels already downloaded are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=.gpu-stage/spx
mkdir -p $STAGE/wheels
PKGS=(
  speculators==0.9.0 hs-connectors==0.9.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  openai==2.6.1 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
for p in "${PKGS[@]}"; do
  name=${p%%==*}; ver=${p##*==}
  ls $STAGE/wheels | grep -qi "^${name//-/_}-${ver}-" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d $STAGE/wheels "$p"
done
rm -rf $STAGE/site && mkdir -p $STAGE/site
for w in $STAGE/wheels/*.whl; do (cd $STAGE/site && unzip -q -o "../wheels/$(basename "$w")"); done
python3 - "$STAGE/site" <<'PY'
import shutil, sys
from importlib.metadata import distribution
from pathlib import Path
dest, dist = Path(sys.argv[1]), distribution("specforge")
site = Path(str(dist.locate_file("")))
for src in (site / "specforge", next(site.glob(f"specforge-{dist.version}.dist-info"))):
    shutil.copytree(src, dest / src.name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
PY
find $STAGE/site -name __pycache__ -prune -exec rm -rf {} +
echo "staged in $STAGE/site ($(du -sm $STAGE/site | cut -f1) MiB): carry $STAGE/site"
