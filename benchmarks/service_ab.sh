#!/usr/bin/env bash
# The service benchmark of two trees on one GPU host, in turn (run-to-run spread between
# machines is large: compare only runs of one machine). On the GPU host, from the checkout's
# root, with .dev/gpu-host carried (benchmarks/gpu_host_prepare.sh) and the older tree laid
# out by benchmarks/service_ab_prepare.sh in .dev/old (carried too; copied to $OLD_COPY,
# /root/old by default, so that later calls on the same machine need not carry it again):
#
#     bash benchmarks/service_ab.sh ORDER [service_gpu.py arguments...]
#
# ORDER: the runs, comma-separated, each `new` (this tree) or `old` (.dev/old), e.g.
# new,old,new. The model, Redis and data arguments are filled in (the 270M shape, fp8, random
# weights) unless given. Each run's JSON goes to $OUT/r (named new-K / old-K) and its output to
# $OUT/{new,old}-K.log; one summary line a run is printed as it ends.
set -uo pipefail
ORDER=$1; shift
ROOT=$PWD
OUT=${OUT:-$ROOT/.dev/out}
mkdir -p "$OUT/r"
OLD_COPY=${OLD_COPY:-/root/old}
source benchmarks/gpu_host_env.sh >/dev/null 2>&1
if [ -d .dev/old ] && [ ! -d "$OLD_COPY" ]; then cp -r .dev/old "$OLD_COPY"; fi
ARGS=("$@")
if [[ " $* " != *" --model "* ]]; then
  ARGS=(--model "$M270" --load-format dummy --quant fp8 "${ARGS[@]}")
fi
ARGS=(--redis-server "$REDIS_SERVER" --data "$DATA" "${ARGS[@]}")
NEW=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || cat "$ROOT/.dev/HEAD")
OLD=$(cat "$OLD_COPY/REVISION" 2>/dev/null || cat "$ROOT/.dev/old/REVISION")
k=0
for tree in ${ORDER//,/ }; do
  k=$((k + 1))
  if [ "$tree" = new ]; then dir=$ROOT commit=$NEW; else dir=$OLD_COPY commit=$OLD; fi
  (cd "$dir" && source benchmarks/gpu_host_env.sh >/dev/null 2>&1 \
     && python3 benchmarks/service_gpu.py "${ARGS[@]}" --commit "$commit" \
        --name "$tree-$k" --out "$OUT/r") > "$OUT/$tree-$k.log" 2>&1
  echo "$tree-$k ($commit):" $(grep -E '^\| [a-z_]*(_vs_engine|_gpu_busy|p99_over_pass) ' \
                                 "$OUT/$tree-$k.log" | tr -d '|')
done
