#!/usr/bin/env bash
# Lay out an older revision in .dev/old for benchmarks/service_ab.sh (here, with git): its
# engine and service, the benchmark modules the GPU host set-up imports, and this tree's
# service benchmark (so both are measured alike): ~2 MB.
#
#     bash benchmarks/service_ab_prepare.sh REV
set -euo pipefail
REV=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OLD=$ROOT/.dev/old
rm -rf "$OLD" && mkdir -p "$OLD"
git -C "$ROOT" archive "$REV" | tar -x -C "$OLD"
rm -rf "$OLD"/tests "$OLD"/docs "$OLD"/fixtures "$OLD"/deploy
find "$OLD/benchmarks" -mindepth 1 -maxdepth 1 \
    ! -name news_questions.json ! -name peers_gpu.py ! -name gpu_host_env.sh \
    ! -name gpu_bench.py ! -name gpu_jobs.py \
    ! -name service_http.py -exec rm -rf {} +
cp "$ROOT/benchmarks/service_gpu.py" "$OLD/benchmarks/"
git -C "$ROOT" rev-parse --short "$REV" > "$OLD/REVISION"
git -C "$ROOT" rev-parse --short HEAD > "$ROOT/.dev/HEAD"
du -sh "$OLD"
