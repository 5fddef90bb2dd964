#!/usr/bin/env bash
# Check and time lmpipe on a CUDA machine in one go: the CUDA tests, then the benchmarks.
#   scripts/gpu_check.sh [tests|ceiling|kernels|ablation|overhead|fp8|precision|resume|loss|loss-memory|ddp|scaling|peers|elastic|all]
#                        [extra benchmark args...]
# Results (logs, bench/results-style .md files, the precision plot) go to $OUT (default /tmp/lmpipe-gpu).
# On the team's lent GPU machine pyzmq and liger-kernel come as wheels in .whl/ (see README, Development),
# and WikiText-2 as a copy in .benchdata/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lmpipe-gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
# lmpipe installs as one package (lmpipe.producer, lmpipe.consumer, lmpipe.shared map onto the folders here)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || { echo "pip install -e . failed"; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export LMPIPE_WIKITEXT=${LMPIPE_WIKITEXT:-$PWD/.benchdata}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-true}
# NVLink multicast stays off on shared GPU hosts (it can take every GPU of the host out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stage=${1:-all}
shift || true

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c "import torch, triton, zmq; print('torch', torch.__version__, 'triton', triton.__version__, 'pyzmq', zmq.__version__)" | tee -a "$OUT/card.txt"
python3 -c "from lmpipe.consumer.model import fused_linear_cross_entropy as f; print('liger fused CE:', f() is not None)" | tee -a "$OUT/card.txt"

run() {  # name, command...
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

test_args=()  # `tests -k loss_kernel` selects tests; `all`'s extra arguments are the benchmarks'
[ "$stage" = tests ] && test_args=("$@")

case $stage in
    # every cuda-marked test, from the files that hold them (others may import CPU-only dev extras)
    tests|all) run cuda-tests python3 -m pytest -q -p no:cacheprovider --durations=8 -m cuda $(grep -l "mark.cuda" tests/test_*.py) "${test_args[@]}" ;;&
    ceiling|all) run ceiling python3 -m bench.ceiling --out "$OUT" "$@" ;;&
    kernels|all) run kernels python3 -m bench.kernels --out "$OUT" "$@" ;;&
    ablation|all) run ablation python3 -m bench.ablation --out "$OUT" "$@" ;;&
    overhead|all) run overhead python3 -m bench.overhead --out "$OUT" "$@" ;;&
    fp8|all) run fp8 python3 -m bench.fp8 --out "$OUT" "$@" ;;&
    precision|all) run precision python3 -m bench.precision --out "$OUT" "$@" ;;&
    resume|all) run resume python3 -m bench.resume --out "$OUT" "$@" ;;&
    loss|all) run loss python3 -m bench.loss --out "$OUT" "$@" ;;&
    loss-memory|all) run loss-memory python3 -m bench.loss_memory --out "$OUT" "$@" ;;&
    ddp) run ddp python3 -m bench.ddp --out "$OUT" "$@" ;;&
    scaling) run scaling python3 -m bench.scaling --out "$OUT" "$@" ;;&
    peers) run peers python3 -m bench.peers --out "$OUT" "$@" ;;&
    elastic) run elastic python3 -m bench.elastic --data "$LMPIPE_WIKITEXT"/*.txt --doc-split heading \
        --seq-len 1024 --batch-size 16 --before 1 --after 4 --out "$OUT" "$@" ;;&
    tests|ceiling|kernels|ablation|overhead|fp8|precision|resume|loss|loss-memory|ddp|scaling|peers|elastic|all) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
esac
cat "$OUT/summary.txt"
