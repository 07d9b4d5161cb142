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
#   peers_device.sh start-sweeps   in the background, after the pipelines above: the sweeps of
#                                  spinf-serve (fp8, bf16), vLLM bf16, vLLM fp8, transformers
#   peers_device.sh poll SECONDS   wait for the pipelines (at most SECONDS), copy what is there
#   peers_device.sh report         merge the parts: $OUT/results/<date>-peers-<commit>.json, and
#                                  the sweeps' <date>-peers-sweeps-<commit>.json (and .png)
#   peers_device.sh serve          optional: vLLM's OpenAI server over HTTP (bf16, 128 in flight),
#                                  then spinf-serve's service (the carried redis-server)
#
# COMMIT (env): the commit the figures are recorded under (the copy has no .git).
# AGREE=0 (env, on start-spinf and start-vllm): skip the agreement parts.
# SWEEP_ARGS (env, on start-sweeps): more arguments for every sweep part.
# PEERS_ROOT (env): another place than /root/peers (a dry run on a CPU).
set -uo pipefail
R=${PEERS_ROOT:-/root/peers}
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
  echo $pid > $R/logs/$name.pid
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

# alive NAME: the pipeline whose pid $R/NAME.pid holds runs
alive() { [ -f $R/$1.pid ] && kill -0 "$(cat $R/$1.pid)" 2>/dev/null; }

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
    alive sweeps && { echo "the sweeps hold the GPU: poll until SWEEPS_DONE first"; exit 1; }
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
    echo $! > $R/spinf.pid
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
    alive sweeps && { echo "the sweeps hold the GPU: poll until SWEEPS_DONE first"; exit 1; }
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
  start-sweeps)
    # ~14 minutes on an H100: spinf ~4, each vLLM ~4 (~170 s of it starting), transformers
    # ~2; the timeouts (20 minutes in all) bound each part, whose points are saved as they finish
    if alive sweeps; then   # an earlier call's, and the part it runs (a session of its own)
      kill -- -"$(cat $R/sweeps.pid)" 2>/dev/null
      for f in $R/logs/sweep-*.pid; do kill -- -"$(cat "$f")" 2>/dev/null; done
      sleep 5
    fi
    # the code of this call, apart from the copy the pipelines above may still be running
    rm -rf $R/proj-sweeps && mkdir -p $R/proj-sweeps
    cp -r "$REPO"/spinf_worker "$REPO"/benchmarks "$REPO"/packs "$REPO"/pyproject.toml $R/proj-sweeps/
    PYTHONPATH=$R/site:$R/proj-sweeps $PY -c "import spinf_worker.engine; print('engine imports')" || exit 1
    rm -f $R/sweeps.done
    P="$PY $R/proj-sweeps/benchmarks/peers_gpu.py"
    SWEEP=(${ARGS[*]} ${SWEEP_ARGS:-})
    setsid nohup bash -c "
      $(declare -f run alive); R=$R; export PYTHONPATH=$R/site:$R/proj-sweeps
      # one side on the GPU at once: the pipelines of start-spinf and start-vllm first
      for i in \$(seq 1 360); do alive spinf || alive pipeline || break; sleep 5; done
      cd $R/proj-sweeps
      run sweep-spinf 360 $P sweep-spinf ${SWEEP[*]}
      run sweep-vllm-bf16 330 $P sweep-vllm --scheme bf16 ${SWEEP[*]}
      run sweep-vllm-fp8 330 $P sweep-vllm --scheme fp8 ${SWEEP[*]}
      run sweep-hf 180 $P sweep-hf ${SWEEP[*]}
      touch $R/sweeps.done" > $R/logs/sweeps-pipeline.log 2>&1 < /dev/null &
    echo $! > $R/sweeps.pid
    echo "sweeps started"
    ;;
  poll)
    end=$((SECONDS + ${2:-540}))
    # while a pipeline runs (a fresh machine has none: don't wait for one)
    while [ $SECONDS -lt $end ] && { alive spinf || alive pipeline || alive sweeps; }; do sleep 5; done
    # two files back ($OUT returns at most eight): the parts' JSON and the logs
    tar -czf "$OUT/parts.tgz" -C $R out 2>/dev/null; tar -czf "$OUT/logs.tgz" -C $R logs 2>/dev/null
    for f in spinf-pipeline pipeline sweeps-pipeline; do
      [ -f $R/logs/$f.log ] && { echo "=== $f"; cat $R/logs/$f.log; }
    done
    for f in spinf agree-spinf vllm-bf16 vllm-fp8 agree-vllm; do
      [ -f $R/logs/$f.log ] || continue
      echo "=== $f"
      grep -E '^\{|Error|Traceback|TIMEOUT' $R/logs/$f.log | grep -v option_logprobs | tail -20 | cut -c1-600
    done
    for f in sweep-spinf sweep-vllm-bf16 sweep-vllm-fp8 sweep-hf; do   # a line per point
      [ -f $R/logs/$f.log ] || continue
      echo "=== $f"
      grep -E '^\{|Error|Traceback|TIMEOUT' $R/logs/$f.log | tail -30 | cut -c1-400
    done
    [ -f $R/pipeline.done ] && echo PIPELINE_DONE
    [ -f $R/sweeps.done ] && echo SWEEPS_DONE
    ! { alive spinf || alive pipeline || alive sweeps; }   # true once none runs: poll && report
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
    sed -n 2,24p "$0"; exit 2 ;;
esac
