#!/usr/bin/env bash
# Check and time lmpipe on a CUDA machine in one go: the CUDA tests, then the benchmarks.
#   scripts/gpu_check.sh [tests|fast|reference-tests|ceiling|kernels|attention|ablation|overhead|fp8|precision|resume|loss|loss-memory|optimizer|qkv|host|gemm-tune|memsets|ddp|scaling|peers|hf-feed|mixture|elastic|rank-restart|checkpoint-cost|warm-start|all]
#                        [extra benchmark args...]
# fast: the CUDA tests (each fast path's parity test against --fast none among them), the trainer tests again
# with LMPIPE_FAST=none (reference-tests alone), and the ablation's "all on" against --fast none, in one run.
# Results (logs, bench/results-style .md files, the precision plot) go to $OUT (default /tmp/lmpipe-gpu).
# On the team's lent GPU machine pyzmq, torchao and nvmath-python come as wheels in .whl/ (see README, Development),
# and WikiText-2 as a copy in .benchdata/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lmpipe-gpu}
mkdir -p "$OUT"
wheels=(.whl/*.whl .fa4b/*.whl)
if compgen -G ".whl/*.whl" >/dev/null || compgen -G ".fa4b/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        $(ls "${wheels[@]}" 2>/dev/null) || exit 1
    # --target skips .pth files: nvidia-cutlass-dsl puts its packages on sys.path with one
    PYTHONPATH=$(python3 -c "import site, sys; old = set(sys.path); site.addsitedir('/tmp/site')
print(':'.join(['/tmp/site'] + [p for p in sys.path if p not in old and p != '/tmp/site']))")
    export PYTHONPATH
fi
# FlashAttention-4 (--attention flash): its CUDA 13 CuTe DSL library (nvidia-cutlass-dsl-libs-cu13, 92 MB)
# is over the lent machine's 64 MiB carry, so it travels unpacked and xz-compressed in two parts: the first
# copied to /tmp/fa4 by an earlier call on the same machine (`cp .fa4a/* /tmp/fa4/`), the second in .fa4b
if [ -f /tmp/fa4/part-aa ] && [ -f .fa4b/part-ab ] && [ ! -d /tmp/site/nvidia_cutlass_dsl/cu13 ]; then
    cat /tmp/fa4/part-aa .fa4b/part-ab | xz -d | tar x -C /tmp/site || exit 1
fi
# lmpipe installs as one package (lmpipe.producer, lmpipe.consumer, lmpipe.shared map onto the folders here)
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || { echo "pip install -e . failed"; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The lent machine sets PYTHONDONTWRITEBYTECODE and its packages come without .pyc: every process compiled
# torch's Python source again, 10-15 s of each start (bench/results/startup-profile-h200-2026-11-28.md). A
# pip install has its bytecode: give Python a cache, filled once per machine, so that start-up figures (and
# every test process) get what a user's install gets.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
    if [ ! -f /tmp/pycache.done ]; then
        purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        python3 -m compileall -q -j 0 "$purelib" /tmp/site "$PWD/lmpipe" >/dev/null 2>&1
        touch /tmp/pycache.done
    fi
fi
export LMPIPE_WIKITEXT=${LMPIPE_WIKITEXT:-$PWD/.benchdata}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-true}
# NVLink multicast stays off on shared GPU hosts (it can take every GPU of the host out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stage=${1:-all}
shift || true

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
python3 -c "import torch, triton, zmq; print('torch', torch.__version__, 'triton', triton.__version__, 'pyzmq', zmq.__version__)" | tee -a "$OUT/card.txt"
python3 -c "from lmpipe.consumer.fast.liger import fused_linear_cross_entropy as f; print('liger fused CE:', f() is not None)" | tee -a "$OUT/card.txt"
python3 -c "import torch; from lmpipe.consumer.fast.flash import problem as u; print('--attention flash:', u(torch.device('cuda')) or 'available')" | tee -a "$OUT/card.txt"
python3 -c "from lmpipe.consumer.fast.cublaslt import nvmath_missing as m; print('nvmath-python (gelu-epilogue, head-gemm):', m() or 'available')" | tee -a "$OUT/card.txt"

run() {  # name, command...
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}

test_args=()  # `tests -k loss_kernel` selects tests; `all`'s extra arguments are the benchmarks'
[ "$stage" = tests ] || [ "$stage" = reference-tests ] && test_args=("$@")
# the files that hold cuda-marked tests (others may import CPU-only dev extras), and those of them that start
# a trainer process: those read LMPIPE_FAST (tests/helpers.py lets it through)
# the unit tier first, each test bounded where pytest-timeout is installed: a test that hangs fails alone
# instead of silencing the whole stage (on 2026-11-28 the stage printed nothing in 540 s with the e2e tier first)
cuda_files=$(grep -rl "mark.cuda" tests/unit --include='test_*.py' | sort; grep -rl "mark.cuda" tests/e2e --include='test_*.py' | sort)
python3 -c "import pytest_timeout" 2>/dev/null && test_args=(--timeout 300 "${test_args[@]}")
trainer_files=$(grep -l "procs.start\|run_lmpipe" $cuda_files)

case $stage in
    # every cuda-marked test, from the files that hold them (others may import CPU-only dev extras)
    tests|fast|all) run cuda-tests python3 -m pytest -q -p no:cacheprovider --durations=8 -m cuda $cuda_files "${test_args[@]}" ;;&
    reference-tests|fast) run cuda-tests-fast-none env LMPIPE_FAST=none python3 -m pytest -q -p no:cacheprovider \
        --durations=8 -m cuda $trainer_files "${test_args[@]}" ;;&
    fast) run ablation-fast python3 -m bench.ablation --only "all on" reference --out "$OUT" "$@" ;;&
    ceiling|all) run ceiling python3 -m bench.ceiling --out "$OUT" "$@" ;;&
    kernels|all) run kernels python3 -m bench.kernels --out "$OUT" "$@" ;;&
    attention|all) run attention python3 -m bench.attention --out "$OUT" "$@" ;;&
    ablation|all) run ablation python3 -m bench.ablation --out "$OUT" "$@" ;;&
    overhead|all) run overhead python3 -m bench.overhead --out "$OUT" "$@" ;;&
    fp8|all) run fp8 python3 -m bench.fp8 --out "$OUT" "$@" ;;&
    precision|all) run precision python3 -m bench.precision --out "$OUT" "$@" ;;&
    resume|all) run resume python3 -m bench.resume --out "$OUT" "$@" ;;&
    loss|all) run loss python3 -m bench.loss --out "$OUT" "$@" ;;&
    loss-memory|all) run loss-memory python3 -m bench.loss_memory --out "$OUT" "$@" ;;&
    optimizer|all) run optimizer python3 -m bench.optimizer --out "$OUT" "$@" ;;&
    qkv|all) run qkv python3 -m bench.qkv --out "$OUT" "$@" ;;&
    host|all) run host python3 -m bench.host --out "$OUT" "$@" ;;&
    gemm-tune) run gemm-tune python3 -m bench.gemm_tune --out "$OUT" "$@" ;;&
    memsets) run memsets python3 -m bench.memset_probe "$@" ;;&
    ddp) run ddp python3 -m bench.ddp --out "$OUT" "$@" ;;&
    scaling) run scaling python3 -m bench.scaling --out "$OUT" "$@" ;;&
    peers) run peers python3 -m bench.peers --out "$OUT" "$@" ;;&
    hf-feed) run hf-feed python3 -m bench.hf_feed --out "$OUT" "$@" ;;&
    mixture) run mixture python3 -m bench.mixture --slow 0.5 --out "$OUT" "$@" ;;&
    checkpoint-cost) run checkpoint-write python3 -m bench.checkpoint_write --out "$OUT"  # the write's parts, on the host
        run checkpoint-cost python3 -m bench.checkpoint_cost --out "$OUT" "$@" ;;&
    warm-start) run warm-start python3 -m bench.warm_start --out "$OUT" "$@" ;;&
    elastic) run elastic python3 -m bench.elastic --data "$LMPIPE_WIKITEXT"/*.txt --doc-split heading \
        --seq-len 1024 --batch-size 16 --before 1 --after 4 --out "$OUT" "$@" ;;&
    rank-restart) run rank-restart python3 -m bench.rank_restart --out "$OUT" "$@" ;;&  # 2 GPUs
    tests|fast|reference-tests|ceiling|kernels|attention|ablation|overhead|fp8|precision|resume|loss|loss-memory|optimizer|qkv|host|gemm-tune|memsets|ddp|scaling|peers|hf-feed|mixture|elastic|rank-restart|checkpoint-cost|warm-start|all) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
esac
cat "$OUT/summary.txt"
