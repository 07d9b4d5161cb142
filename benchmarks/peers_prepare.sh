#!/usr/bin/env bash
# Lay out what the GPU machine needs to run vLLM 0.26 beside spinf-serve (benchmarks/peers_gpu.py)
# under the ignored .dev/peers/, in carry folders of at most 60 MiB each, and print the device
# calls to make. Runs here, on the CPU, with network access to PyPI:
#
#     bash benchmarks/peers_prepare.sh [--tokenizer DIR] [--data DIR]
#
# The vLLM wheel (~300 MB) is trimmed of what the H200 does not load (FlashAttention 2, the MoE
# kernels, the vllm-rs binary, DeepGEMM builds for other Pythons), repacked as one xz tar and
# split; the small pure/cp312 wheels vLLM and the engine import are carried as they are.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=$ROOT/.dev/peers
TOKENIZER=${SPINF_TOKENIZER:-$HOME/.cache/spinf-serve/models/google--gemma-3-270m}
DATA=${SPINF_SHARED_DATA:-$ROOT/../shared/data}
BUDGET=$((58 * 1024 * 1024))        # bytes a call carries: 64 MiB less the checkout (~4 MiB)
while [ $# -gt 0 ]; do
  case $1 in
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
PIP=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform any)

rm -rf "$PEERS/dl/wheels"     # this run's versions only
mkdir -p "$PEERS/dl/vllm" "$PEERS/dl/wheels"
# vLLM itself, then what it and the engine import that the device lacks (it has torch 2.11,
# numpy, transformers 5.17, tokenizers, safetensors, triton, jinja2, pyyaml, tqdm, requests).
# Version bounds are vLLM 0.26's own (its METADATA); xgrammar 0.2.8 and later need a newer
# apache-tvm-ffi than the one vLLM pins.
"${PIP[@]}" -d "$PEERS/dl/vllm" vllm==0.26.0
SMALL=(cbor2 pyzmq msgspec pybase64 cachetools "openai>=2.0.0,<3" jiter httpx httpcore h11 anyio
       sniffio idna certifi distro truststore "openai-harmony>=0.0.3" "llguidance>=1.7.0,<1.8.0"
       "xgrammar>=0.2.1,<0.2.8" apache-tvm-ffi==0.1.10 "fastapi>=0.133.0,<0.137.0"
       "starlette>=1.0.1" python-multipart email-validator dnspython partial-json-parser
       "pydantic>=2.12.0" annotated-types typing-inspection "mistral_common>=1.11.5"
       pydantic-extra-types pycountry "jsonschema>=4.23.0" referencing rpds-py
       jsonschema-specifications attrs dill blake3 py-cpuinfo psutil sentencepiece
       "tiktoken>=0.6.0" gguf "prometheus_client>=0.18.0" "prometheus-fastapi-instrumentator>=8.0.0"
       lark==1.2.2 outlines_core==0.2.14 lm-format-enforcer==0.11.3 interegular
       compressed-tensors==0.17.0 depyf==0.20.0 astor cloudpickle einops setproctitle ijson
       python-json-logger uvicorn click watchfiles six platformdirs diskcache requests urllib3
       charset-normalizer typing_extensions annotated-doc loguru packaging
       "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*"
       orjson structlog pydantic-settings python-dotenv redis)
"${PIP[@]}" -d "$PEERS/dl/wheels" "${SMALL[@]}"
# pydantic-core at the exact version the downloaded pydantic pins
CORE=$(unzip -p "$PEERS"/dl/wheels/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: \(pydantic-core==[^ ;]*\).*/\1/p')
"${PIP[@]}" -d "$PEERS/dl/wheels" "$CORE"

# the trimmed vLLM, as one xz tar (built once; rebuilt when the wheel changes)
WHEEL=$(ls "$PEERS"/dl/vllm/vllm-0.26.0-*.whl)
TAR=$PEERS/dl/vllm-trimmed.tar.xz
if [ ! -f "$TAR" ] || [ "$WHEEL" -nt "$TAR" ]; then
  rm -rf "$PEERS/dl/unpacked" && mkdir -p "$PEERS/dl/unpacked"
  (cd "$PEERS/dl/unpacked" && unzip -q "$WHEEL")
  rm -f "$PEERS"/dl/unpacked/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
        "$PEERS"/dl/unpacked/vllm/_moe_C_stable_libtorch.abi3.so \
        "$PEERS"/dl/unpacked/vllm/vllm-rs
  find "$PEERS/dl/unpacked/vllm/third_party" -name '_C.cpython-*.so' ! -name '*-312-*' -delete
  (cd "$PEERS/dl/unpacked" && tar -cf - vllm vllm-0.26.0.dist-info | xz -9 -T0 > "$TAR.tmp")
  mv "$TAR.tmp" "$TAR"
  rm -rf "$PEERS/dl/unpacked"
fi

# carry folders: c1 = the small wheels, the tokenizer, the news articles and the first piece;
# c2.. = the other pieces. Each at most BUDGET bytes.
rm -rf "$PEERS"/c[0-9]*
mkdir -p "$PEERS/c1/wheels"
cp "$PEERS"/dl/wheels/*.whl "$PEERS/c1/wheels/"
if [ ! -f "$PEERS/dl/tokenizer.json.xz" ] || [ "$TOKENIZER/tokenizer.json" -nt "$PEERS/dl/tokenizer.json.xz" ]; then
  xz -9 -c "$TOKENIZER/tokenizer.json" > "$PEERS/dl/tokenizer.json.xz"
fi
cp "$PEERS/dl/tokenizer.json.xz" "$PEERS/c1/"
cp "$TOKENIZER/tokenizer_config.json" "$PEERS/c1/" 2>/dev/null || true
cp "$DATA/news_articles.jsonl" "$PEERS/c1/"
(cd "$PEERS/dl" && sha256sum vllm-trimmed.tar.xz > "$PEERS/c1/vllm-trimmed.sha256")
used=$(du -sb "$PEERS/c1" | cut -f1)
first=$((BUDGET - used))
total=$(stat -c %s "$TAR")
n=1
head -c "$first" "$TAR" > "$PEERS/c1/vllm.part01"
offset=$first
while [ "$offset" -lt "$total" ]; do
  n=$((n + 1))
  mkdir -p "$PEERS/c$n"
  tail -c +"$((offset + 1))" "$TAR" | head -c "$BUDGET" > "$PEERS/c$n/vllm.part$(printf %02d $n)"
  offset=$((offset + BUDGET))
done
echo "$n" > "$PEERS/c1/calls"
# the optional `serve` part's spinf-serve service runs a private redis-server (7.0 ran there)
REDIS=$(command -v redis-server || true)
if [ -n "$REDIS" ]; then
  cp "$(readlink -f "$REDIS")" "$PEERS/c$n/redis-server"
  # the libraries Debian's build links that the GPU machine lacks (libc, ssl, systemd it has)
  mkdir -p "$PEERS/c$n/redis-libs"
  ldd "$(readlink -f "$REDIS")" | awk '/jemalloc|lzf|atomic/ {print $3}' \
    | xargs -r cp -L -t "$PEERS/c$n/redis-libs"
fi

echo "== sizes"
du -sh "$WHEEL" "$TAR" "$PEERS/dl/wheels"
echo "small wheels: $(ls "$PEERS"/dl/wheels/*.whl | wc -l)"
for c in $(seq 1 "$n"); do echo "carry .dev/peers/c$c: $(du -sb "$PEERS/c$c" | cut -f1) bytes"; done
cat "$PEERS/c1/vllm-trimmed.sha256"

echo
COMMIT=$(git -C "$ROOT" rev-parse --short HEAD)
echo "== device calls (nvidia-h200), back to back (within 30 s: /root survives while the machine"
echo "   is warm), from a checkout of commit $COMMIT (the figures are recorded under it)"
for c in $(seq 1 "$n"); do
  cmd="bash benchmarks/peers_device.sh stage .dev/peers/c$c"
  if [ "$c" = 1 ]; then cmd="COMMIT=$COMMIT $cmd"; fi
  if [ "$c" = 1 ]; then cmd="$cmd && bash benchmarks/peers_device.sh start-spinf"; fi
  if [ "$c" = "$n" ]; then cmd="$cmd && bash benchmarks/peers_device.sh install && bash benchmarks/peers_device.sh start-vllm && bash benchmarks/peers_device.sh poll 400"; fi
  echo "call $c: carry [\".dev/peers/c$c\"]  timeout_s 600"
  echo "    $cmd"
done
echo "call $((n + 1)): no carry  timeout_s 600   (again until it prints PIPELINE_DONE)"
echo "    bash benchmarks/peers_device.sh poll 540 && bash benchmarks/peers_device.sh report"
echo "optional, after PIPELINE_DONE: no carry  timeout_s 600"
echo "    bash benchmarks/peers_device.sh serve"
