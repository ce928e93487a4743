#!/bin/bash
# One call of a GPU session's `make gpu-check`, split to fit the device tool's limits (10 minutes a
# call, 15 minutes a session, 8 files back): install the carried wheels (.whl, benchmarks/README.md),
# then run the parts named, each under its own time limit, each report in its own folder of $OUT.
#   bash benchmarks/gpu_session.sh tests hybrid        # first call (~10 minutes: timeout_s 600)
#   bash benchmarks/gpu_session.sh decode hostwork     # second call, with what is left
# Parts: tests (the GPU test files, each test under a 150 s limit), hybrid (the hybrid >= 2x goals),
# hybridgen (bench_hybrid.py's generation, eager and compile_decode, vs HF generate on CUDA), decode
# (decode floor, compiles and graph recordings, host overhead, SmolLM2-135M), hostwork
# (bench_decode_host.py: nopad's decode step's host work beside HF's), graphcode (the compiled
# decode step's generated copy kernels), attention (training and generation, SmolLM2-135M), grpo,
# realshapes (the decode floor at 64/128/256 sequences, serial and overlapped, the GPU's idle share of
# a compiled step, and generation against HF generate and HF continuous batching, on a Qwen2.5-1.5B
# shape, bf16, random weights: one call of ~9 minutes), realshapes8b (the same on Llama-3.1-8B,
# without the idle share), realhybrid (the hybrid goals on a Qwen3.5-2B-like shape), streaming
# (bench_streaming_rl.py: nopad sync, streaming at max_staleness 1 and 2, TRL GRPOTrainer; #52's goals).
set -u
for part in "$@"; do  # before the install: a typo costs no device time
  case $part in tests|hybrid|hybridgen|decode|hostwork|graphcode|attention|grpo|realshapes|realshapes8b|realhybrid|streaming) ;;
    *) echo "unknown part $part (tests hybrid hybridgen decode hostwork graphcode attention grpo realshapes realshapes8b realhybrid streaming)"; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "name the parts to run: tests hybrid hybridgen decode hostwork graphcode attention grpo realshapes realshapes8b realhybrid streaming"; exit 2; }
out=${OUT:-gpu_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || { echo "install the wheels first: benchmarks/README.md"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
all="pytest train generate decode host grpo hybrid"
run() {  # run PART SECONDS GPU_CHECK_ARGS...: gpu_check with everything but the named steps skipped
  local part=$1 seconds=$2 keep=$3; shift 3
  local skip; skip=$(for s in $all; do [[ " $keep " == *" $s "* ]] || printf '%s ' "$s"; done)
  # shellcheck disable=SC2086
  timeout "$seconds" python3 benchmarks/gpu_check.py --skip $skip --out "$out/$part" "$@" \
    > "$out/$part.log" 2>&1
  echo "$part: rc $? after $SECONDS s" | tee -a "$out/$part.log"
  # the device tool returns 8 files a call: one log and one report per part (the report's .md
  # carries the raw JSON; the pytest logs go into the part's log)
  for f in "$out/$part"/pytest_*.log; do [ -e "$f" ] && { echo "== $f"; cat "$f"; rm "$f"; } >> "$out/$part.log"; done
  rm -f "$out/$part/gpu_report.json"
}
for part in "$@"; do
  case $part in
    tests)
      # (whether fla trains here: the hybrid test file and the hybrid part each report it; a probe of
      # its own cost ~100 s of kernel compilation on the H100)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/env.log" 2>&1
      run tests 290 "pytest" ;;
    hostwork)
      timeout 200 python3 benchmarks/bench_decode_host.py --device cuda --shape smollm2 > "$out/hostwork.log" 2>&1
      echo "hostwork: rc $? after $SECONDS s" | tee -a "$out/hostwork.log" ;;
    graphcode)  # the compiled decode step's CUDA code: the H100 profiled a copy kernel of 0.5 ms a
      # step (triton_poi_fused_copy__view_4), about a whole K/V cache's worth; is the cache copied?
      TORCH_LOGS=output_code timeout 200 python3 benchmarks/gpu_check.py --skip pytest train generate \
        host grpo hybrid --models SmolLM2-135M --decode-counts 64 --out "$out/graphcode" 2>&1 \
        | grep -B3 -A40 "def triton_poi_fused_copy" > "$out/graphcode.log"
      rm -rf "$out/graphcode"; echo "graphcode: after $SECONDS s" >> "$out/graphcode.log" ;;
    hybrid) run hybrid 280 "hybrid" ;;
    hybridgen)  # the hybrid Generator eager and with compile_decode (CUDA graphs) vs HF generate, wall s
      timeout 250 python3 benchmarks/bench_hybrid.py --models '' --exact-mode off --prefix-cache '' \
        --generation qwen3_5,lfm2,bamba --dtypes bfloat16 --compile-decode --device cuda > "$out/hybridgen.log" 2>&1
      echo "hybridgen: rc $? after $SECONDS s" | tee -a "$out/hybridgen.log" ;;
    decode) run decode 200 "decode host" --models SmolLM2-135M ;;
    attention) run attention 330 "train generate" --models SmolLM2-135M ;;
    grpo) run grpo 300 "grpo" --models SmolLM2-135M ;;
    realshapes) run realshapes 560 "decode host generate" --models Qwen2.5-1.5B --decode-counts 64 128 256 ;;
    realshapes8b) run realshapes8b 560 "decode generate" --models Llama-3.1-8B --decode-counts 64 128 256 ;;
    realhybrid) run realhybrid 300 "hybrid" --hybrid-models Qwen3.5-2B-like ;;
    streaming)  # streaming GRPO vs sync and TRL on the GPU, where a step of 4 rows costs what one of 32 does
      timeout 540 python3 benchmarks/bench_streaming_rl.py --device cuda --dtype bfloat16 --systems "sync,s=1 keep,s=2 keep" \
        > "$out/streaming.log" 2>&1
      echo "streaming: rc $? after $SECONDS s" | tee -a "$out/streaming.log" ;;
    *) echo "unknown part $part (tests hybrid hybridgen decode hostwork graphcode attention grpo realshapes realshapes8b realhybrid streaming)"; exit 2 ;;
  esac
done
