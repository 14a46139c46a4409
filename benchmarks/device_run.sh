#!/usr/bin/env bash
# One device call that checks and measures everything, within the 10-minute limit.
#   run: bash benchmarks/device_run.sh [tests|tests-1|tests-2|tests-3|bench|rows|det|bench-d128|features|flex|varlen|varlen-onepass|decode|fold-ab|decode-wave|decode-ab|transformers|provider|sweep|gluon-bwd|onepass|qsplit|onepass-ncu|fwd-schedule|train5|decode-users|host-ab|spread-bench|graph-ab|all]   (from the repo root)
# Writes logs and a tarball of benchmark rows under $OUT (at most 8 files come back). One-off modes
# of finished experiments are gone from here once recorded (git log -p names them, perf-notes their runs).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flashtile-out}
mkdir -p "$OUT" /tmp/bench
what=${1:-all}
# Row files are named after the card they ran on (h100-..., h200-...; the image's nvidia-smi)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]00' | tr H h)
gpu=${gpu:-gpu}

# The bench rows of /tmp/bench/$1*.jsonl side by side: mode and shape (decode rows), or heads,
# head dim, length and pass (prefill rows), then us per step for each tag (the file name after $1;
# prefill rows of another impl than flashtile or cuDNN as impl:tag).
rows_by_tag() {
  python3 - "$1" <<'PY'
import collections, glob, json, sys
prefix = sys.argv[1]
us = collections.defaultdict(dict)
for f in sorted(glob.glob(f"/tmp/bench/{prefix}*.jsonl")):
    tag = f.split("/")[-1][len(prefix):-len(".jsonl")]
    for line in open(f):
        r = json.loads(line)
        if r.get("ms"):
            key = (r["mode"], r["label"]) if "label" in r else (
                f"{r['nheads']}/{r['nheads_k']} d{r['headdim']}", f"S{r['seqlen_q']} {r['pass']}")
            impl = "" if "label" in r or r["impl"] in ("flashtile", "sdpa-cudnn") else r["impl"] + ":"
            us[key][impl + tag] = r["ms"] * 1e3
for (mode, label), row in us.items():
    print(mode, label, " ".join(f"{t}={v:.2f}" for t, v in sorted(row.items())))
PY
}
(nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
 python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
 # what decode's split rule sees (decode.wave_per_sm: DRAM GB/s per SM against WAVE_GBPS_PER_SM)
 python3 -c "import torch; from flashtile.runtime.device import dram_gbps, sm_count; from flashtile.backends.triton import decode
print('dram GB/s', dram_gbps(0), 'SMs', sm_count(0), 'wave_per_sm', decode.wave_per_sm(torch.device('cuda', 0)))"
) > "$OUT/env.txt" 2>&1

if [[ $what == tests || $what == all || $what == tests-1 || $what == tests-2 || $what == tests-3 ]]; then
  # -n 6: compiles run in parallel on the host's cores (at -n 8 an H100's 80 GB ran out: run 132).
  # -v: each result is logged as it comes (run 78 hit the limit at 95% with 3 failures that
  # -q would only have named at the end). The whole suite is ~1450 tests and runs past one
  # call's 600 s: `tests-1` (the backward and varlen files), `tests-2` (the rest but the newest
  # files) and `tests-3` (issues 35-37: sinks, chunks, head dims, flex, the SDPA provider) split it.
  part1="tests/backends/test_backward_gpu.py tests/backends/sm90/test_sm90_backward_gpu.py tests/api/test_varlen_gpu.py"
  part3="tests/api/test_sinks_gpu.py tests/api/test_chunks_gpu.py tests/api/test_head_dims_gpu.py
         tests/api/test_flex_gpu.py tests/integrations/test_torch_sdpa_gpu.py
         tests/integrations/test_continuous_batching_gpu.py"
  # tests that need tens of GB each run alone after the parallel run (at -n 6 they ran out of
  # memory beside five other workers: run 137)
  big="tests/backends/test_forward_gpu.py::test_long_sequence tests/backends/test_forward_gpu.py::test_offsets_beyond_int32"
  case $what in
    tests-1) sel="$part1"; dsl=""; alone="" ;;
    tests-2) sel="tests"; dsl=$(for f in $part1 $part3 $big; do printf -- "--deselect %s " "$f"; done); alone="$big" ;;
    tests-3) sel="$part3"; dsl=""; alone="" ;;
    *) sel="tests"; dsl=$(for f in $big; do printf -- "--deselect %s " "$f"; done); alone="$big" ;;
  esac
  timeout ${TESTS_TIMEOUT:-480} python3 -m pytest -m gpu $sel $dsl -v -rf -n ${TESTS_WORKERS:-6} \
    --maxfail=30 -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu-tests.log" | cut -c1-200 | tail -15
  if [[ -n $alone ]]; then
    timeout 120 python3 -m pytest -m gpu $alone -v -rf -p no:warnings -p no:cacheprovider >> "$OUT/gpu-tests.log" 2>&1
    echo "gpu tests alone rc=$?"; tail -2 "$OUT/gpu-tests.log" | cut -c1-200
  fi
fi
if [[ $what == bench || $what == all ]]; then
  timeout 60 python3 benchmarks/host_overhead.py > "$OUT/host-overhead.log" 2>&1
  echo "host overhead rc=$?"; grep -v Warn "$OUT/host-overhead.log"
  timeout 200 python3 -m flashtile.tools.bench --dtype bf16 --pass fwd bwd --impl flashtile sdpa-flash sdpa-cudnn \
    --out /tmp/bench --tag ${gpu}-bf16 > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  FLASHTILE_BWD_DQ=atomic timeout 90 python3 -m flashtile.tools.bench --dtype bf16 --pass bwd --impl flashtile \
    --headdim 64 128 --out /tmp/bench --tag ${gpu}-bf16-atomic-dq > "$OUT/bench-atomic.log" 2>&1
  echo "bench atomic-dq rc=$?"
  timeout 120 python3 -m flashtile.tools.bench --dtype bf16 --pass bwd --impl flashtile flashtile-det \
    --headdim 64 128 --seqlen 2048 8192 --out /tmp/bench --tag ${gpu}-bf16-deterministic > "$OUT/bench-det.log" 2>&1
  echo "bench deterministic rc=$?"; grep "| bwd " "$OUT/bench-det.log" | tail -8
  timeout 60 python3 benchmarks/train_block.py --seqlen 8192 --out /tmp/bench/train-block.jsonl > "$OUT/train-block.log" 2>&1
  echo "train block rc=$?"; tail -6 "$OUT/train-block.log"
  tar czf "$OUT/bench.tgz" -C /tmp/bench .
  grep "| fwd \|| bwd " "$OUT/bench.log" | awk -F'|' '{print $2,$3,$5,$6,$7,$8,$9,$10,$12,$13}' | tail -40
fi
if [[ $what == rows ]]; then
  # The issue's target rows on one card (H200 for issue 38): `flashtile bench` bf16 and fp16,
  # forward and backward, every shape, against PyTorch's flash and cuDNN; the host cost per call.
  timeout 60 python3 benchmarks/host_overhead.py > /tmp/bench/host-overhead.log 2>&1
  echo "host overhead rc=$?"; grep -v Warn /tmp/bench/host-overhead.log | tail -12
  for dt in ${ROWS_DTYPES:-bf16 fp16}; do
    timeout ${BENCH_TIMEOUT:-230} python3 -m flashtile.tools.bench --dtype $dt --pass fwd bwd \
      --impl flashtile sdpa-flash sdpa-cudnn --out /tmp/bench --tag ${gpu}-$dt > /tmp/bench/bench-$dt.log 2>&1
    echo "bench $dt rc=$?"
    grep "| bwd " /tmp/bench/bench-$dt.log | awk -F'|' '{print $2,$3,$5,$6,$7,$8,$9,$10,$12,$13}' | tail -24
  done
  tar czf "$OUT/rows.tgz" -C /tmp/bench .
fi
if [[ $what == fold-ab ]]; then
  # Session 36's eager fold A/B, never read (run 204's host was slow), now also by the wall clock
  # (session 46's eager_wall: the fold trades about 4 us of GPU time for host time, which the
  # eager rows leave out). Generation steps at batch 1 x 4k/8k and batch 2 x 4k, the fold (auto)
  # against two launches (spread check, separate combine), three alternating rounds, then cuDNN;
  # host rows first (twice: a quiet host has cuDNN's eager forward near 38 us). About 400 s.
  for r in 1 2; do
    timeout 75 python3 benchmarks/host_overhead.py --impl flashtile sdpa-cudnn > "$OUT/host-overhead-r$r.log" 2>&1
    echo "host overhead round $r rc=$?"; grep -v Warn "$OUT/host-overhead-r$r.log" | tail -12
  done
  for r in 1 2 3; do
    for cfg in auto split; do
      sw=""; [[ $cfg == split ]] && sw="FLASHTILE_DECODE_CHECK=spread FLASHTILE_DECODE_COMBINE=separate"
      env $sw timeout 45 python3 -m flashtile.tools.bench --decode --append --mode eager eager_wall --only 10 11 14 \
        --impl flashtile --out /tmp/bench --tag fold-$cfg-r$r > /tmp/bench/fold-$cfg-r$r.log 2>&1
      echo "fold $cfg round $r rc=$?"
    done
  done
  timeout 45 python3 -m flashtile.tools.bench --decode --append --mode eager eager_wall --only 10 11 14 \
    --impl sdpa-cudnn --out /tmp/bench --tag fold-cudnn > /tmp/bench/fold-cudnn.log 2>&1
  echo "fold cudnn rc=$?"
  rows_by_tag fold- | tee "$OUT/fold-ab.txt"
  tar -czf "$OUT/fold-ab.tgz" -C /tmp/bench .
fi
if [[ $what == decode-wave ]]; then
  # Session 38: two programs per SM in the one wave of long splits where the DRAM feeds more
  # than WAVE_GBPS_PER_SM per SM (an H200; an H100 keeps one: env.txt says which this card
  # takes). The kv-cache GPU file, the decode table against cuDNN (compare run 211; its three
  # modes: eager, CUDA graphs and eager_wall since session 46), then the rows whose count the
  # rule changes on an H200 at both counts and their neighbours.
  timeout 130 python3 -m pytest -m gpu tests/api/test_kvcache_gpu.py -q -n 8 --maxfail=20 -p no:warnings \
    -p no:cacheprovider > "$OUT/gpu-tests-kvcache.log" 2>&1
  rc=$?; echo "kvcache gpu tests rc=$rc"; grep -E "passed|failed|FAILED" "$OUT/gpu-tests-kvcache.log" | tail -12
  if [[ $rc == 0 ]]; then
    timeout 240 python3 -m flashtile.tools.bench --decode --out /tmp/bench --tag ${gpu}-decode > "$OUT/bench-decode.log" 2>&1
    echo "decode bench rc=$?"; grep -v Warn "$OUT/bench-decode.log" | grep "^|" | tail -54
    cp /tmp/bench/${gpu}-decode* "$OUT/" 2>/dev/null
    timeout ${WAVE_SWEEP_TIMEOUT:-150} python3 benchmarks/sweep_decode.py --only 0 1 2 5 7 13 17 19 21 --splits 0 2 4 8 16 33 \
      > "$OUT/sweep-decode-wave.log" 2>&1
    echo "wave sweep rc=$?"; grep -v Warn "$OUT/sweep-decode-wave.log" | tail -30
  fi
fi
if [[ $what == bench-d128 ]]; then
  # Issue 34's check: d128 bf16 forward and backward against run 100's rows, host cost included.
  timeout 60 python3 benchmarks/host_overhead.py > "$OUT/host-overhead.log" 2>&1
  echo "host overhead rc=$?"; grep -v Warn "$OUT/host-overhead.log" | tail -12
  timeout ${BENCH_TIMEOUT:-200} python3 -m flashtile.tools.bench --dtype bf16 --pass fwd bwd --headdim 128 \
    --impl flashtile sdpa-cudnn --out /tmp/bench --tag ${gpu}-bf16-d128 > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  grep "| fwd \|| bwd " "$OUT/bench.log" | awk -F'|' '{print $2,$3,$5,$6,$7,$8,$9,$10,$12,$13}' | tail -24
  tar czf "$OUT/bench.tgz" -C /tmp/bench .
fi
if [[ $what == flex ]]; then
  # Issue 35: the flex GPU tests, then flex_attention against torch's compiled Flex.
  timeout ${FLEX_TESTS_TIMEOUT:-200} python3 -m pytest -m gpu tests/api/test_flex_gpu.py -q -n ${TESTS_WORKERS:-8} \
    --maxfail=20 -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-flex.log" 2>&1
  echo "flex gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests-flex.log" | cut -c1-300 | tail -25
  timeout ${FLEX_BENCH_TIMEOUT:-300} python3 -m flashtile.tools.bench --flex ${FLEX_BENCH_ARGS:-} --out /tmp/bench \
    --tag ${gpu}-flex > "$OUT/bench-flex.log" 2>&1
  echo "flex bench rc=$?"; grep "^|" "$OUT/bench-flex.log" | tail -60
  cp /tmp/bench/${gpu}-flex* "$OUT/" 2>/dev/null
fi
if [[ $what == features ]]; then
  # Issue 36: sinks and chunks against the same call without them, head dim 512 and (192, 128).
  timeout ${FEATURES_TIMEOUT:-240} python3 benchmarks/features.py ${FEATURES_ARGS:-} --out "$OUT/features.jsonl" \
    > "$OUT/features.log" 2>&1
  echo "features rc=$?"; tail -40 "$OUT/features.log" | cut -c1-260
fi
if [[ $what == varlen ]]; then
  # Packed sequences: their GPU tests first (a fault ends here), then the varlen benchmark.
  timeout 240 python3 -m pytest -m gpu tests/api/test_varlen_gpu.py -q -n 8 --maxfail=20 -p no:warnings \
    -p no:cacheprovider > "$OUT/gpu-tests-varlen.log" 2>&1
  echo "varlen gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests-varlen.log" | cut -c1-300 | tail -25
  timeout 330 python3 -m flashtile.tools.bench --varlen --warmup 5 --rep 25 --out /tmp/bench --tag ${gpu}-varlen \
    ${VARLEN_BENCH_ARGS:-} > "$OUT/bench-varlen.log" 2>&1
  echo "varlen bench rc=$?"; grep -v Warning "$OUT/bench-varlen.log" | grep "^|" | tail -30
  cp /tmp/bench/${gpu}-varlen* "$OUT/" 2>/dev/null
fi
if [[ $what == decode ]]; then
  # KV-cache decoding: its GPU tests first (a fault ends here), then the split sweep and the bench.
  timeout ${DECODE_TESTS_TIMEOUT:-200} python3 -m pytest -m gpu tests/api/test_kvcache_gpu.py -q -n 8 --maxfail=20 \
    -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-kvcache.log" 2>&1
  echo "kvcache gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests-kvcache.log" | cut -c1-300 | tail -25
  if [[ -n ${DECODE_SWEEP:-} ]]; then
    timeout ${DECODE_SWEEP_TIMEOUT:-150} python3 benchmarks/sweep_decode.py $DECODE_SWEEP > "$OUT/sweep-decode.log" 2>&1
    echo "decode sweep rc=$?"; grep -v Warn "$OUT/sweep-decode.log" | tail -60
  fi
  timeout ${DECODE_BENCH_TIMEOUT:-340} python3 -m flashtile.tools.bench --decode --out /tmp/bench --tag ${gpu}-decode \
    ${DECODE_BENCH_ARGS:-} > "$OUT/bench-decode.log" 2>&1
  echo "decode bench rc=$?"; grep -v Warn "$OUT/bench-decode.log" | tail -45
  cp /tmp/bench/${gpu}-decode* "$OUT/" 2>/dev/null
fi
if [[ $what == transformers ]]; then
  # The transformers integration: its GPU tests, then training steps and generation of a 1.1B
  # random-weight Llama with each attn_implementation (benchmarks/transformers_step.py).
  timeout ${TF_TESTS_TIMEOUT:-150} python3 -m pytest -m gpu tests/integrations/test_transformers_gpu.py tests/tools/test_check_gpu.py -q \
    -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-transformers.log" 2>&1
  echo "transformers gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests-transformers.log" | tail -10
  timeout ${TF_BENCH_TIMEOUT:-400} python3 benchmarks/transformers_step.py --out "$OUT/transformers-step.jsonl" \
    ${TF_BENCH_ARGS:-} > "$OUT/transformers-step.log" 2>&1
  echo "transformers step rc=$?"; grep -v Warn "$OUT/transformers-step.log" | tail -14
fi
if [[ $what == provider ]]; then
  # Issue 37: the SDPA provider (its host cost, its speed against flashtile's direct call and
  # PyTorch's flash backend, a training step through transformers' "sdpa") and continuous
  # batching (generate_batch on flashtile_fa2 against transformers' paged sdpa).
  timeout 70 python3 benchmarks/host_overhead.py --impl flashtile sdpa-flash sdpa-flashtile \
    > "$OUT/host-provider.log" 2>&1
  echo "host overhead rc=$?"; grep -v Warn "$OUT/host-provider.log"
  timeout 200 python3 -m flashtile.tools.bench --dtype bf16 --pass fwd bwd --impl flashtile sdpa-flash sdpa-flashtile \
    --headdim 64 128 --seqlen 2048 8192 16384 --out /tmp/bench --tag ${gpu}-bf16-provider > "$OUT/bench-provider.log" 2>&1
  echo "bench provider rc=$?"; grep -A40 "TFLOP/s" /tmp/bench/${gpu}-bf16-provider-summary.md | tail -30
  timeout ${PROVIDER_TRAIN_TIMEOUT:-160} python3 benchmarks/transformers_step.py --impl sdpa "sdpa[flash]" sdpa+flashtile \
    tiled_attention --workload train-full --steps 10 --out /tmp/bench/provider-train.jsonl > /tmp/bench/provider-train.log 2>&1
  echo "provider train rc=$?"; grep -v Warn /tmp/bench/provider-train.log | tail -6
  timeout ${CB_TIMEOUT:-140} python3 benchmarks/transformers_step.py --impl flashtile_fa2 sdpa --workload cb \
    --out /tmp/bench/cb.jsonl > /tmp/bench/cb.log 2>&1
  echo "continuous batching rc=$?"; grep -v -i "warn\|psutil" /tmp/bench/cb.log | tail -5
  # everything in one tarball: at most 8 files come back
  tar -czf "$OUT/provider.tgz" -C /tmp/bench ${gpu}-bf16-provider.jsonl ${gpu}-bf16-provider-summary.md \
    provider-train.jsonl provider-train.log cb.jsonl cb.log 2>/dev/null
fi
if [[ $what == decode-ab ]]; then
  # Issue 38's decode folds, A/B in one call: generation steps (--append) of flashtile alone,
  # eager and CUDA graphs, with the append kernel / the append in the decode kernel (the
  # default) / the combine fused too / the device check fused too (one launch a step). Each
  # configuration names all three switches (the combine's and the check's default, ``auto``,
  # folds an eager step under 48 MiB of cache: ``decode.fuse_step``).
  # Shapes: B8 L4k, B8 L32k, B64 L8k, B8 L32k page 16, B1-B4 at 4k-32k, B4 page 16.
  only="0 1 3 6 10 11 13 14 15 18 19 21 23 25"
  for cfg in "separate separate separate" "fused separate separate" "fused fused separate" "fused fused fused"; do
    set -- $cfg
    FLASHTILE_DECODE_APPEND=$1 FLASHTILE_DECODE_COMBINE=$2 FLASHTILE_DECODE_CHECK=$3 timeout ${DECODE_AB_TIMEOUT:-150} \
      python3 -m flashtile.tools.bench --decode --append --impl flashtile --only $only --out /tmp/bench \
      --tag "${gpu}-decode-append-$1-combine-$2-check-$3" > "/tmp/bench/decode-ab-$1-$2-$3.log" 2>&1
    echo "decode append=$1 combine=$2 check=$3 rc=$?"; grep -E "^B" "/tmp/bench/decode-ab-$1-$2-$3.log" | tail -28
  done
  timeout 40 python3 benchmarks/host_overhead.py --only kvcache > "$OUT/host-decode.log" 2>&1  # the defaults (auto)
  for sw in "FLASHTILE_DECODE_COMBINE=separate FLASHTILE_DECODE_CHECK=separate" \
            "FLASHTILE_DECODE_APPEND=separate FLASHTILE_DECODE_COMBINE=separate FLASHTILE_DECODE_CHECK=separate" \
            "FLASHTILE_DECODE_COMBINE=fused FLASHTILE_DECODE_CHECK=separate" \
            "FLASHTILE_DECODE_COMBINE=fused FLASHTILE_DECODE_CHECK=fused"; do
    echo "# $sw" >> "$OUT/host-decode.log"
    env $sw timeout 40 python3 benchmarks/host_overhead.py --only kvcache --impl flashtile >> "$OUT/host-decode.log" 2>&1
  done
  echo "host overhead rc=$?"; grep -v Warn "$OUT/host-decode.log"
  tar -czf "$OUT/decode-ab.tgz" -C /tmp/bench $(cd /tmp/bench && ls ${gpu}-decode-append-* decode-ab-*.log 2>/dev/null)
fi
if [[ $what == varlen-onepass ]]; then
  # Issue 38: packed calls on the one-pass backward (FLASHTILE_BWD_DQ=onepass; session 23, compiled
  # only): its GPU test, then the varlen backward rows under the split kernels (today's default)
  # and under it. Make it the default for packed calls only if the test passes and it wins.
  timeout 200 python3 -m pytest -m gpu tests/backends/sm90/test_sm90_backward_gpu.py -k "packed or race_hunt" -v \
    -n 4 -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-varlen-onepass.log" 2>&1
  echo "varlen one-pass gpu tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests-varlen-onepass.log" | cut -c1-300 | tail -12
  for mode in split onepass; do
    FLASHTILE_BWD_DQ=$mode timeout 150 python3 -m flashtile.tools.bench --varlen --pass bwd --impl flashtile \
      --headdim 64 128 --warmup 5 --rep 25 --out /tmp/bench --tag ${gpu}-varlen-bwd-$mode > "$OUT/bench-varlen-$mode.log" 2>&1
    echo "varlen bwd $mode rc=$?"; grep -v Warning "$OUT/bench-varlen-$mode.log" | grep "^|" | tail -14
  done
  cp /tmp/bench/${gpu}-varlen-bwd-* "$OUT/" 2>/dev/null
fi
if [[ $what == sweep ]]; then
  timeout 280 python3 benchmarks/sweep_bwd.py --out "$OUT/sweep-bwd.jsonl" > "$OUT/sweep-bwd.log" 2>&1
  echo "sweep bwd rc=$?"; sed -n '/best per shape/,$p' "$OUT/sweep-bwd.log"
  timeout 250 python3 benchmarks/sweep_fwd.py --dtype bf16 --seqlen 512 1024 --out "$OUT/sweep-fwd.jsonl" > "$OUT/sweep-fwd.log" 2>&1
  echo "sweep fwd rc=$?"; sed -n '/best per shape/,$p' "$OUT/sweep-fwd.log"
fi
if [[ $what == gluon-bwd ]]; then
  # The Gluon backward's variants: correctness on odd shapes, then TF/s (each kernel alone too)
  # next to the library's backward, the Triton backward and cuDNN.
  timeout 240 python3 benchmarks/experiments/gluon_bwd.py --split > "$OUT/gluon-bwd.log" 2>&1
  echo "gluon bwd rc=$?"; grep -v Warning "$OUT/gluon-bwd.log" | tail -20
fi
if [[ $what == det ]]; then
  # Session 42: the deterministic backward. Its GPU tests (the one-pass kernel's ordered dQ sums
  # and the split kernels' bitwise test), then flashtile-det against the default, bf16, S2048-16384,
  # under FLASHTILE_BWD_DQ=auto (the split kernels for causal calls below 2048 queries, else one-pass)
  # and =onepass (one-pass at every length), then the host cost per call (autograd._eager_apply).
  timeout 150 python3 -m pytest -m gpu tests/backends/sm90/test_sm90_backward_gpu.py -k "deterministic or bitwise" -q \
    -n 8 -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-det.log" 2>&1
  echo "det gpu tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu-tests-det.log" | tail -8
  for path in auto onepass; do
    FLASHTILE_BWD_DQ=$path timeout 120 python3 -m flashtile.tools.bench --dtype bf16 --pass bwd --impl flashtile \
      flashtile-det --headdim 64 128 --seqlen 2048 4096 8192 16384 --out /tmp/bench --tag ${gpu}-bf16-det-$path \
      > /tmp/bench/bench-det-$path.log 2>&1
    echo "det bench $path rc=$?"; grep "| bwd " /tmp/bench/bench-det-$path.log | awk -F'|' '{print $2,$3,$5,$8,$9,$12}'
  done
  timeout 60 python3 benchmarks/host_overhead.py > /tmp/bench/host-overhead.log 2>&1
  echo "host overhead rc=$?"; grep -v Warn /tmp/bench/host-overhead.log | tail -12
  tar czf "$OUT/det.tgz" -C /tmp/bench .
fi
if [[ $what == onepass ]]; then
  # Issue 17's one-pass backward (backends/sm90/backward_onepass.py, the default at d64): its
  # ring sizes next to the library's backward, the Triton backward and cuDNN.
  timeout ${ONEPASS_TIMEOUT:-240} python3 benchmarks/experiments/gluon_bwd_onepass.py ${ONEPASS_ARGS:-} \
    > "$OUT/onepass.log" 2>&1
  echo "onepass rc=$?"; grep -v Warning "$OUT/onepass.log" | tail -16
fi
if [[ $what == qsplit ]]; then
  # Session 51: d64's warpgroups split each step's queries (backward_onepass.Q_SPLIT, compiled only).
  # Its GPU test first (a never-run kernel: a hang or a wrong sum ends here), then the kernel alone
  # against today's (2,1) at S2048-16384 (the split with one dQ slot and with two: 229,888 B), then
  # ncu of today's and the split at S4096 (L1/TEX and tensor pipe: perf-notes' session 51 model).
  timeout 200 python3 -m pytest -m gpu tests/backends/sm90/test_sm90_backward_gpu.py -k query_split -v \
    -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-qsplit.log" 2>&1
  rc=$?; echo "qsplit gpu tests rc=$rc"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu-tests-qsplit.log" | tail -8
  if [[ $rc == 0 ]]; then
    timeout 300 python3 benchmarks/experiments/gluon_bwd_onepass.py --variants "2,1;2,1,-1,-1,qsplit;2,2,-1,-1,qsplit" \
      --shapes "64,2048,0;64,4096,0;64,8192,0;64,16384,0;64,2048,1;64,4096,1;64,8192,1;64,16384,1" \
      > "$OUT/qsplit-ab.log" 2>&1
    echo "qsplit ab rc=$?"; grep -v Warning "$OUT/qsplit-ab.log" | tail -24
    ncu=$(ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    metrics=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
    metrics+=,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum
    for variant in 2,1 2,1,-1,-1,qsplit; do
      timeout 80 $ncu -k regex:onepass_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight --metrics $metrics \
        python3 benchmarks/experiments/gluon_bwd_onepass.py --profile 64,4096,0 --variants $variant \
        > "$OUT/qsplit-ncu-${variant//,/_}.log" 2>&1
      echo "ncu $variant rc=$?"; grep -E "Duration|Throughput|pct|local_op" "$OUT/qsplit-ncu-${variant//,/_}.log" | head -12
    done
  fi
fi
if [[ $what == onepass-ncu ]]; then
  # Where the one-pass kernel's time goes, on one shape under Nsight Compute: speed of
  # light, warp stalls, shared-memory bank conflicts, spills (local bytes), L2 reductions.
  # (Session 16's A/B against no reductions used the experiment at 47aaad2, FLASHTILE_EXP_DQ=1.)
  ncu=$(ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  shape=${NCU_SHAPE:-128,4096,0}; variant=${NCU_VARIANT:-2,2}
  timeout 200 $ncu -k regex:onepass_kernel --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,lts__t_sectors_op_red.sum \
    python3 benchmarks/experiments/gluon_bwd_onepass.py --profile $shape --variants $variant \
    > "$OUT/onepass-ncu.log" 2>&1
  echo "onepass ncu rc=$?"
  grep -E "Duration|Throughput|Pipe|Stall|Warp Cycles|bank_conflicts|wavefronts|local_op|op_red|Registers|ERR" \
    "$OUT/onepass-ncu.log" | head -40
fi
if [[ $what == fwd-schedule ]]; then
  # The forward's schedules (one program per item, static persistent, dynamic) and cuDNN,
  # then the WS forward GPU tests, which cover the dynamic schedule.
  # First one shape (a never-run kernel: a hang or a fault ends here, in 90 s at most).
  timeout 90 python3 benchmarks/experiments/fwd_schedule.py --shapes 128,2048,1 > "$OUT/fwd-schedule-smoke.log" 2>&1
  rc=$?; echo "fwd schedule smoke rc=$rc"; grep -v Warning "$OUT/fwd-schedule-smoke.log" | tail -5
  if [[ $rc == 0 ]]; then
    timeout 300 python3 benchmarks/experiments/fwd_schedule.py > "$OUT/fwd-schedule.log" 2>&1
    echo "fwd schedule rc=$?"; grep -v Warning "$OUT/fwd-schedule.log" | tail -20
    timeout 200 python3 -m pytest -m gpu tests/backends/sm90/test_sm90_forward_gpu.py -q -n 8 -p no:warnings -p no:cacheprovider \
      > "$OUT/gpu-tests-ws-fwd.log" 2>&1
    echo "ws fwd tests rc=$?"; tail -n 3 "$OUT/gpu-tests-ws-fwd.log"
  fi
fi
if [[ $what == train5 ]]; then
  # Issue 38's training-step target: train_block.py with its no-attention and deterministic rows,
  # TRAIN_ROUNDS rounds in one process, the order rotated each round; attention's time = step -
  # that round's no-attention step, the median over rounds (run 253's five processes of one
  # round each read flashtile's step 20.7-21.8 ms). The first round also names each step's
  # kernels (--kernels: attention's own, with their GPU time) and the GPU's idle time inside
  # do_bench-style steps (--timeline).
  timeout ${TRAIN_TIMEOUT:-240} python3 benchmarks/train_block.py --seqlen 8192 --out "$OUT/train-block-rounds.jsonl" \
    --rounds ${TRAIN_ROUNDS:-8} --rep ${TRAIN_REP:-400} --kernels 5 --timeline 5 \
    --impls flashtile sdpa-cudnn flashtile-deterministic no-attention > "$OUT/train-block-rounds.log" 2>&1
  echo "train block rc=$?"; grep -vE "^round [1-9]" "$OUT/train-block-rounds.log" | grep -v Warn | cut -c1-600 | tail -24
fi
if [[ $what == decode-users ]]; then
  # Every GPU file with a decode call besides the kv-cache file's own (run 144 ran them with
  # FLASHTILE_PDL off; PDL is the default since session 30): transformers, continuous
  # batching, sinks, chunks, head dims (MLA's 576 / 512 decode), check.
  timeout ${DU_TESTS_TIMEOUT:-480} python3 -m pytest -m gpu tests/integrations/test_transformers_gpu.py \
    tests/integrations/test_continuous_batching_gpu.py tests/api/test_sinks_gpu.py tests/api/test_chunks_gpu.py \
    tests/api/test_head_dims_gpu.py tests/tools/test_check_gpu.py \
    -v -rf -n ${TESTS_WORKERS:-6} --maxfail=30 -p no:warnings -p no:cacheprovider > "$OUT/gpu-tests-decode-users.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "passed|failed|FAILED" "$OUT/gpu-tests-decode-users.log" | cut -c1-200 | tail -15
fi
if [[ $what == spread-bench ]]; then
  # Generation steps (--append) under CUDA graphs on cold inputs, the check kernel (separate)
  # against the spread check (auto), alternating twice, then cuDNN; then eager steps whose
  # cache read is past decode.FUSE_BYTES_MAX (auto: spread there too).
  only="10 11 12 13 14 15 18 19 22 23"
  for r in 1 2; do
    for check in separate auto; do
      FLASHTILE_DECODE_CHECK=$check timeout 100 python3 -m flashtile.tools.bench --decode --append --impl flashtile \
        --mode cuda_graph --only $only --out /tmp/bench --tag "spread-graph-$check-r$r" > /tmp/bench/spread-graph-$check-r$r.log 2>&1
      echo "graph $check round $r rc=$?"
    done
  done
  timeout 100 python3 -m flashtile.tools.bench --decode --impl sdpa-cudnn --mode cuda_graph --only $only --out /tmp/bench \
    --tag spread-graph-cudnn > /tmp/bench/spread-graph-cudnn.log 2>&1
  echo "graph cudnn rc=$?"
  for check in separate auto; do
    FLASHTILE_DECODE_CHECK=$check timeout 120 python3 -m flashtile.tools.bench --decode --append --impl flashtile \
      --mode eager --only 0 1 3 6 20 21 25 --out /tmp/bench --tag "spread-eager-$check" > /tmp/bench/spread-eager-$check.log 2>&1
    echo "eager $check rc=$?"
  done
  rows_by_tag spread-
  tar -czf "$OUT/spread-bench.tgz" -C /tmp/bench $(cd /tmp/bench && ls spread-*) 2>/dev/null
fi
if [[ $what == graph-ab ]]; then
  # Generation steps under CUDA graphs (cold inputs), an old src tree (AB_OLD, e.g. `git archive
  # <rev> src | tar -x -C headsrc`, carried: AB_OLD=headsrc/src) against this one, alternating,
  # cuDNN after the first round; rows AB_ROWS (bench --decode indices), rounds AB_ROUNDS; the new
  # side AB_NEW (default src).
  rows=${AB_ROWS:-"0 1 2 7 10 11 13 15 17 19 20"}
  for r in $(seq 1 ${AB_ROUNDS:-2}); do
    for side in old new; do
      pp=${AB_NEW:-src}; [[ $side == old ]] && pp=$AB_OLD
      PYTHONPATH=$pp timeout 100 python3 -m flashtile.tools.bench --decode --append --impl flashtile \
        --mode cuda_graph --only $rows --out /tmp/bench --tag "ab-$side-r$r" > /tmp/bench/ab-$side-r$r.log 2>&1
      echo "graph $side round $r rc=$?"
    done
    if [[ $r == 1 ]]; then
      timeout 100 python3 -m flashtile.tools.bench --decode --impl sdpa-cudnn --mode cuda_graph --only $rows \
        --out /tmp/bench --tag ab-cudnn > /tmp/bench/ab-cudnn.log 2>&1
      echo "graph cudnn rc=$?"
    fi
    tar -czf "$OUT/graph-ab.tgz" -C /tmp/bench $(cd /tmp/bench && ls ab-*) 2>/dev/null
  done
  rows_by_tag ab-
fi
if [[ $what == host-ab ]]; then
  # Host cost before and after a change, alternating in one call: HOST_AB_OLD names a src
  # tree (e.g. `git archive <rev> src | tar -x -C headsrc`, carried: HOST_AB_OLD=headsrc/src).
  # First a probe: the lent machines' hosts have run every row 10-100% slow (session 30);
  # a quiet host gives cuDNN's eager forward near 36 us (H100 run 146).
  timeout 40 python3 benchmarks/host_overhead.py --impl sdpa-cudnn --only "fwd, no grad" > "$OUT/host-ab.log" 2>&1
  grep -v Warn "$OUT/host-ab.log"
  for i in 1 2 3; do
    echo "## old ${HOST_AB_OLD:?set HOST_AB_OLD} round $i" >> "$OUT/host-ab.log"
    PYTHONPATH=$HOST_AB_OLD timeout 60 python3 benchmarks/host_overhead.py --impl flashtile ${HOST_AB_ARGS:-} \
      >> "$OUT/host-ab.log" 2>&1
    echo "## new round $i" >> "$OUT/host-ab.log"
    timeout 60 python3 benchmarks/host_overhead.py --impl flashtile sdpa-cudnn ${HOST_AB_ARGS:-} >> "$OUT/host-ab.log" 2>&1
  done
  grep -v Warn "$OUT/host-ab.log" | grep -v "^# "
fi
