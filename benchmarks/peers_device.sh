#!/usr/bin/env bash
# On the GPU machine: install what benchmarks/peers_prepare.sh laid out and run
# benchmarks/peers_gpu.py's parts, one process after the other (vLLM and spinf-serve never hold
# the GPU at once). Everything lives under /root/peers, which survives between back-to-back
# calls; figures are copied to $OUT by `poll` and `report`.
#
#   peers_device.sh stage DIR      copy a carry folder (.dev/peers/cN) to /root/peers; wheels
#                                  are installed into /root/peers/site at once
#   peers_device.sh start-spinf    in the background: spinf (12B shape, fp8, bf16), then
#                                  agree-spinf (writes the 1B-shaped shared weights)
#   peers_device.sh install        join the vLLM pieces, check their sha256, extract
#   peers_device.sh start-vllm     in the background, after spinf: vllm bf16, vllm fp8, agree-vllm
#   peers_device.sh poll SECONDS   wait for the pipeline (at most SECONDS), copy what is there
#   peers_device.sh report         merge the parts: $OUT/results/<date>-peers-<commit>.json
#   peers_device.sh serve          optional: vLLM's OpenAI server over HTTP (bf16, 128 in flight),
#                                  then spinf-serve's service (the carried redis-server)
#
# COMMIT (env): the commit the figures are recorded under (the copy has no .git).
# AGREE=0 (env, on start-spinf and start-vllm): skip the agreement parts.
set -uo pipefail
R=/root/peers
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
COMMIT=${COMMIT:-$(cat $R/commit 2>/dev/null || git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export PYTHONPATH=$R/site:$R/proj HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
       DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
# PEERS_ARGS (env): more arguments for every part, e.g. "--tiny --docs 2" for a dry run on a CPU
ARGS=(--tokenizer $R/tok --data $R/data --out $R/out --commit "$COMMIT" --model-dir $R/models
      --weights $R/weights-1b ${PEERS_ARGS:-})
mkdir -p $R/site $R/pieces $R/tok $R/data $R/out $R/logs $R/models

# run NAME TIMEOUT CMD...: CMD in its own session, killed with its children after TIMEOUT s
run() {
  local name=$1 limit=$2; shift 2
  echo "$(date +%T) start $name"
  setsid "$@" > $R/logs/$name.log 2>&1 < /dev/null &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null; do
    sleep 2; t=$((t + 2))
    if [ $t -ge "$limit" ]; then
      echo "$name TIMEOUT"; kill -- -$pid; sleep 5; kill -9 -- -$pid 2>/dev/null; break
    fi
  done
  wait $pid; local rc=$?
  echo "$(date +%T) $name rc $rc after $t s"
  sleep 2; kill -9 -- -$pid 2>/dev/null   # vLLM's engine core, should it outlive its parent
  return 0
}

case ${1:-} in
  stage)
    src=$2
    [ -d "$src/wheels" ] && $PY -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target $R/site "$src"/wheels/*.whl 2>&1 | tail -3
    cp "$src"/vllm.part* $R/pieces/
    [ -f "$src/vllm-trimmed.sha256" ] && cp "$src/vllm-trimmed.sha256" $R/
    [ -f "$src/news_articles.jsonl" ] && cp "$src/news_articles.jsonl" $R/data/
    [ -f "$src/redis-server" ] && cp "$src/redis-server" $R/ && chmod +x $R/redis-server
    [ -d "$src/redis-libs" ] && mkdir -p $R/redis-libs && cp "$src"/redis-libs/* $R/redis-libs/
    [ -f "$src/tokenizer_config.json" ] && cp "$src/tokenizer_config.json" $R/tok/
    if [ -f "$src/tokenizer.json.xz" ]; then
      $PY -c "import lzma, sys; open('$R/tok/tokenizer.json', 'wb').write(lzma.open(sys.argv[1]).read())" \
          "$src/tokenizer.json.xz"
    fi
    echo "$COMMIT" > $R/commit
    ls -la $R/pieces; df -h /root | tail -1
    nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
    ;;
  start-spinf)
    # the project's code copied out of the checkout: the next call replaces the checkout
    rm -rf $R/proj && mkdir -p $R/proj
    cp -r "$REPO"/spinf_worker "$REPO"/benchmarks "$REPO"/packs "$REPO"/pyproject.toml $R/proj/
    $PY -c "import spinf_worker.engine; print('engine imports')" || exit 1
    rm -f $R/spinf.done
    setsid nohup bash -c "
      $(declare -f run); R=$R
      run spinf 900 $PY $R/proj/benchmarks/peers_gpu.py spinf ${ARGS[*]}
      [ ${AGREE:-1} = 1 ] && run agree-spinf 600 $PY $R/proj/benchmarks/peers_gpu.py agree-spinf ${ARGS[*]}
      touch $R/spinf.done" > $R/logs/spinf-pipeline.log 2>&1 < /dev/null &
    sleep 20; cat $R/logs/spinf-pipeline.log; tail -c 1500 $R/logs/spinf.log
    ;;
  install)
    cat $R/pieces/vllm.part* > $R/vllm-trimmed.tar.xz
    (cd $R && sha256sum -c vllm-trimmed.sha256) || exit 1
    t=$SECONDS
    $PY -c "import tarfile; tarfile.open('$R/vllm-trimmed.tar.xz').extractall('$R/site')" || exit 1
    echo "extracted in $((SECONDS - t)) s"; rm -f $R/pieces/vllm.part* $R/vllm-trimmed.tar.xz
    du -sh $R/site
    timeout 150 $PY -c "import vllm; from vllm import LLM, SamplingParams; print('vllm', vllm.__version__)" 2>&1 | tail -5
    ;;
  start-vllm)
    # a pipeline left by an earlier call (still waiting for the spinf parts) would run beside
    # this one and take the GPU: end it first
    [ -f $R/pipeline.pid ] && kill -- -"$(cat $R/pipeline.pid)" 2>/dev/null
    rm -f $R/pipeline.done
    setsid nohup bash -c "
      $(declare -f run); R=$R
      for i in \$(seq 1 180); do [ -f $R/spinf.done ] && break; sleep 5; done
      nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader -l 2 > $R/logs/smi.log 2>&1 &
      smi=\$!
      cd $R/proj
      run vllm-bf16 480 $PY $R/proj/benchmarks/peers_gpu.py vllm --scheme bf16 ${ARGS[*]}
      run vllm-fp8 480 $PY $R/proj/benchmarks/peers_gpu.py vllm --scheme fp8 ${ARGS[*]}
      [ ${AGREE:-1} = 1 ] && run agree-vllm 400 $PY $R/proj/benchmarks/peers_gpu.py agree-vllm ${ARGS[*]}
      kill \$smi; touch $R/pipeline.done" > $R/logs/pipeline.log 2>&1 < /dev/null &
    echo $! > $R/pipeline.pid
    echo "pipeline started"
    ;;
  poll)
    end=$((SECONDS + ${2:-540}))
    # a fresh machine has no pipeline: don't wait for one
    while [ $SECONDS -lt $end ] && [ ! -f $R/pipeline.done ] \
          && kill -0 "$(cat $R/pipeline.pid 2>/dev/null || echo 0)" 2>/dev/null; do sleep 5; done
    # two files back ($OUT returns at most eight): the parts' JSON and the logs
    tar -czf "$OUT/parts.tgz" -C $R out 2>/dev/null; tar -czf "$OUT/logs.tgz" -C $R logs 2>/dev/null
    for f in spinf-pipeline pipeline; do echo "=== $f"; cat $R/logs/$f.log 2>/dev/null; done
    for f in spinf agree-spinf vllm-bf16 vllm-fp8 agree-vllm; do
      echo "=== $f"
      grep -E '^\{|Error|Traceback|TIMEOUT' $R/logs/$f.log 2>/dev/null | grep -v option_logprobs | tail -20 | cut -c1-600
    done
    [ -f $R/pipeline.done ] && echo PIPELINE_DONE
    ;;
  report)
    $PY "$REPO"/benchmarks/peers_gpu.py report --out $R/out --results "$OUT"/results --commit "$COMMIT"
    ;;
  serve)
    redis=(); [ -x $R/redis-server ] && redis=(--redis-server $R/redis-server)
    export LD_LIBRARY_PATH=$R/redis-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    cd $R/proj && run serve 560 $PY $R/proj/benchmarks/peers_gpu.py serve ${ARGS[*]} ${redis[*]}
    cp $R/out/*-peers-serve-*.json "$OUT"/ 2>/dev/null; tar -czf "$OUT/serve-logs.tgz" -C $R logs
    tail -c 3000 $R/logs/serve.log
    ;;
  *)
    sed -n 2,19p "$0"; exit 2 ;;
esac
