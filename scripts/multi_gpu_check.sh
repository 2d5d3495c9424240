#!/usr/bin/env bash
# The multi-GPU runs (tests, lockstep capture, benchmarks), for a 4-GPU machine (2-GPU parts
# run on 2); on the lent GPU machines, after `cp ../shared/device/prelude.sh .device/`:
#   source .device/prelude.sh && bash scripts/multi_gpu_check.sh tests     # logs under $OUT
#   source .device/prelude.sh && bash scripts/multi_gpu_check.sh capture bench
# Stages: tests (~4 min), capture (~1.5 min), bench (~5 min); each command has its own time
# limit so one hang cannot eat the rest. Split them over two device calls (10 min each).
set -u
out=${OUT:-/tmp}
stages=${*:-tests capture bench}
python3 -m bench.checkpoints /tmp/raygraph-bench/llama-1b --preset llama-1b >/dev/null 2>&1 &
python3 -m bench.checkpoints /tmp/raygraph-bench/mixtral-1b --preset mixtral-1b >/dev/null 2>&1 &
if [[ " $stages " == *" tests "* ]]; then
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/multirank -m gpu \
      > "$out/multirank_gpu.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/multirank_gpu.log" | tail -8
fi
wait
[[ " $stages " == *" capture "* ]] && for args in "--model /tmp/raygraph-bench/llama-1b --tp 4" \
            "--model /tmp/raygraph-bench/mixtral-1b --tp 2 --dp 2 --ep 4"; do
    echo "=== raygraph check-capture $args"
    log="$out/check_capture_$(echo "$args" | tr -dc 'a-z0-9' | tail -c 10).log"
    timeout 120 python3 -m raygraph.cli check-capture $args > "$log" 2>&1
    echo "rc=$?"; grep -E "keys on|agree on every|FAILED" "$log"
done
[[ " $stages " == *" bench "* ]] && for args in "--tp 2" "--tp 4" "--tp 1 --dp 2 --ep 2 --preset mixtral-1b" \
            "--tp 2 --dp 2 --ep 4 --preset mixtral-1b"; do
    echo "=== python3 -m bench.parallel_decode $args --batches 1 8 32 --iters 30"
    timeout 110 python3 -m bench.parallel_decode $args --batches 1 8 32 --iters 30 2>&1 \
        | grep -E '^\||"lockstep_capture_s"'
done
