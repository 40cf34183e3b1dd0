#!/usr/bin/env bash
# Build llama.cpp restricted to one x86 instruction set, for issue 35's side-by-side runs of each quanta path:
#   scripts/llama_cpp_isa.sh avx2|avx_vnni [DIR]
# Takes the vendored llama.cpp of the llama-cpp-python release installed in .venv (the one `make test` builds), builds
# its shared libraries without native flags (AVX/AVX2/FMA/F16C/BMI2, plus AVX-VNNI for avx_vnni; no AVX-512), checks
# that no zmm register made it in, and prints the line that points llama-cpp-python at them. Then, e.g.:
#   LLAMA_CPP_LIB_PATH=... quanta bench -m smollm2-135m --vs llama.cpp --cpu-isa avx2 -p 128 -n 64 --threads 1
# About 3 minutes on 2 cores (the library targets only).
set -euo pipefail
cd "$(dirname "$0")/.."
isa="${1:?usage: scripts/llama_cpp_isa.sh avx2|avx_vnni [DIR]}"
case "$isa" in
  avx2) vnni=OFF ;;
  avx_vnni) vnni=ON ;;
  *) echo "unknown instruction set '$isa' (avx2 or avx_vnni; AVX-512 VNNI is the native build of make test)" >&2
     exit 2 ;;
esac
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
dir="${2:-$HOME/.cache/quanta/llama.cpp-$version-$isa}"
src="$dir/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -d "$src" ]; then
  mkdir -p "$dir/src"
  .venv/bin/python -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir/src"
  tar -xzf "$dir/src/llama_cpp_python-$version.tar.gz" -C "$dir/src"
fi
cmake -S "$src" -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=$vnni \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
  > "$dir/configure.log"
cmake --build "$dir/build" -j "$(nproc)" --target llama llama-common ggml-cpu > "$dir/build.log"
if objdump -d "$dir/build/bin/libggml-cpu.so" | grep -q zmm; then
  echo "libggml-cpu.so uses zmm registers: not an $isa-only build" >&2
  exit 1
fi
echo "export LLAMA_CPP_LIB_PATH=$dir/build/bin"
