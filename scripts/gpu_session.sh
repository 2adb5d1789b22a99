#!/usr/bin/env bash
# A session's GPU work in one command, on a machine with torch and the bundles but without this
# package installed (the device machine). Writes logs and results under $OUT.
#
#   . .device/tilelang/1/env.sh && bash scripts/gpu_session.sh tests check
#   . .device/tilelang-fi/3/env.sh && bash scripts/gpu_session.sh tests bench-prefill bench-decode
#
# Steps: tests (pytest -m gpu), check (qla-serving check), batch-invariance (one sequence alone and in
# a larger call of the decode and prefill kernels, QLA_BATCH_INVARIANT off and on; one prompt whole and cut
# in two calls, ours and FLA's), bench-prefill, bench-decode,
# profile-prefill (Nsight Compute on prep and chunk_fwd: one chain-bound cell, 2/8 heads 1x8192
# without AutoCP, and one throughput-bound cell, 16/64 heads 8x4096; details page and per-SASS-line
# stall samples, the hottest lines summarised by scripts/ncu_hot.py, all in
# $OUT/profile-prefill.tar.xz; the .ncu-rep files stay in /tmp, they are large).
# serve (the serving benchmark, e2e_bench/serve.py, arguments in QLA_SERVE_ARGS; the servers' and
# clients' logs of every run in /tmp go back as $OUT/serve-logs.tar.xz).
# serve-split (the serving benchmark's servers side by side, one per GPU: QLA_SERVE_SPLIT="GPU:BACKEND[:SAMPLE]
# ...", each server with the common QLA_SERVE_ARGS, its own port and vLLM cache; then one results file
# of them all in $OUT, each backend row naming its GPU; each run's log in serve-logs.tar.xz as
# qla-serve-split-gpu<GPU>-<BACKEND>.log: the lent machine returns few files per call). Slots may share
# GPUs ("0,1,2,3:flashqla 0,1,2,3:triton": two TP 4 servers on one 4-GPU host, each given its share of
# memory in QLA_SERVE_ARGS): they then measure in turns, one server at a time, each with its own vLLM cache.
# QLA_SPLIT_CPUS=even gives each slot of serve-split / stress-split an equal share of the CPUs of its
# own (taskset), so that servers side by side do not run on each other's cores (a concurrency-1 step
# is host-bound: docs/e2e.md, "Host time"); QLA_SPLIT_CPUS=local pins each slot to the CPUs of its
# GPUs' NUMA node instead, so that servers taking turns on the same GPUs run on the same, nearest CPUs.
# stress (the reliability harness, e2e_bench/stress.py, arguments in QLA_STRESS_ARGS; logs back as
# $OUT/stress-logs.tar.xz).
# stress-split (the reliability harness's servers side by side: QLA_STRESS_SPLIT="GPUS:BACKEND:PHASE[:K,K...|:I/N] ...",
# GPUS one GPU or a comma-separated group for --tp > 1, PHASE stress (its backend's oracle first, then the
# stress server; beside an oracle slot of its backend, at once, comparing once that oracle is saved), oracle (the oracle alone; oracle:I/N its I-th of N shards, N such slots side by side),
# or spec (the K speculative servers, comparing once the stress run's oracle is there; spec:METHOD:K,K...
# names the slot's proposer, mtp or ngram, over --spec-method),
# each with the common QLA_STRESS_ARGS; then one results file of them all in $OUT; on SGLang a slot whose GPUs
# an earlier slot uses starts once that slot's server is up).
# stress-runs (stress runs side by side, run i on GPU i, QLA_STRESS_RUNS="ARGS0|ARGS1|..." after the common
# QLA_STRESS_ARGS, each in its own work directory with a carried oracle, .device/stress-oracle, unpacked into it
# (`--oracle-as FROM:TO` in a run's arguments gives backend TO the oracle of FROM); run i's results and progress
# back as s<i>/ in $OUT/stress-runs-results.tar.xz, the servers' logs as $OUT/stress-runs-logs.tar.xz).
# install (the install proof, e2e_bench/install.py, arguments in QLA_INSTALL_ARGS; servers' logs back
# as $OUT/install-logs.tar.xz; with QLA_DOCKERFILE=docker/Dockerfile.vllm the wheel goes in by that
# Dockerfile's pip line, offline, into a fresh environment over the image and the bundles: the
# Dockerfile replayed and served on the GPU).
# caches-save (Triton's and FlashInfer's JIT caches of this machine as pieces jit-caches.tar.xz.NN in
# $OUT) and caches-restore (the pieces carried in .device/jit-caches, unpacked into $HOME before any
# server starts: a fresh machine then starts its servers warm; scripts/device_caches.sh keeps them here).
# library (the shipped kernel library built here with every CPU, `qla-serving compile --shipped`, into
# QLA_LIBRARY_OUT, default /tmp/qla-lib: a 64-core machine builds it in about 6 minutes, a 2-core one in
# an hour; later steps and calls use it with QLA_KERNEL_LIBRARY=/tmp/qla-lib; needs the tilelang-fi bundle;
# it comes back as $OUT/qla-lib.tar.xz.NN, a few MiB, for `python scripts/library_unpack.py` to ship).
# library-from-wheel (the shipped library of a built wheel carried in the call, QLA_WHEEL a path in the
# checkout, unpacked into QLA_LIBRARY_OUT, default /tmp/qla-lib, and the wheel kept in QLA_DIST_DIR, default /tmp/qla-dist,
# for a later call's install step: a wheel of 37 MiB fits a call beside the small last tilelang-fi part).
# tests-background (the tests and check steps started in a process session of their own, which
# outlives this call: the machine works through them while the next calls copy bundle parts) and
# tests-wait (in a later call on the same machine: waits up to QLA_SUITE_WAIT seconds, default 600,
# for them, prints their summary, returns their logs as $OUT/gpu-tests.tar.xz and their status).
# Extra pytest arguments: QLA_PYTEST_ARGS="-k decode"; QLA_TEST_SHARDS=N runs the tests as N processes,
# shard i on GPU i mod the GPU count (QLA_TEST_GPUS="2,3" keeps them to those GPUs; default: one per GPU the machine has; more than the GPUs share them,
# which overlaps one GPU's compiles and launches: its suite took 377 s in one process).
set -uo pipefail
# every `tar -J` here compresses on all CPUs, so packing a call's oracles and logs stays inside its limit
export XZ_OPT=${XZ_OPT:--T0}
here=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/qla-out}
mkdir -p "$OUT"
. "$here/scripts/gpu_stage.sh"
cd "$QLA_STAGE"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
# The servers of serve-split / stress-split: one harness run per slot (GPUS:BACKEND:REST, GPUS one
# GPU or a comma-separated group), in the background with its own GPUs, port and vLLM cache, then the
# harness's --collect of what they saved. REST: serve's server sample, or stress's PHASE[:K,K...].
# Servers run in sessions of their own; one that outlived an earlier call on a machine kept warm
# (a call ended at its time limit) would hold its GPU and port.
# The JIT caches a cold engine start fills (caches-save / caches-restore), under $HOME.
jit_cache_dirs=(.triton/cache .cache/flashinfer)
stop_leftover_servers() {
  local pids
  pids=$(pgrep -f "vllm.entrypoints.cli.main serve|sglang.launch_server" || true)
  [[ -z $pids ]] && return 0
  echo "stopping servers left by an earlier call: $(echo $pids)"
  kill $pids 2>/dev/null; sleep 10; kill -9 $pids 2>/dev/null || true
}
library_summary() {  # DIR ORIGIN: a library's manifest in a line, and its shared object's hash
  python3 - "$1" "$2" <<'PY'
import json, pathlib, sys
out, origin = pathlib.Path(sys.argv[1]), sys.argv[2]
m = json.loads((out / "manifest.json").read_text())
print(f"library {m['source_digest']} from {origin}: {len(m['configs'])} configurations, "
      f"{len(m['kernels'])} kernels, built with {m['built_with']}, in {out} (QLA_KERNEL_LIBRARY={out})")
PY
  sha256sum "$1"/*.so
}
side_by_side() {  # MODULE ARGS SLOTS LOG_PREFIX PATTERN [LINES: of each log's matches shown, default all]
  local module=$1 args=$2 slots=$3 prefix=$4 pattern=$5 lines=${6:-+1} rc=0 i=0 slot gpus backend rest phase ks log out local_cpus
  local -a extra pin cpus slot_gpus slot_logs slot_pids
  local stamp nslots per turns j
  stamp=$(date +%s%N) nslots=$(wc -w <<<"$slots")
  mapfile -t cpus < <(python3 -c "import os; print(*sorted(os.sched_getaffinity(0)), sep='\n')")
  per=$((${#cpus[@]} / nslots))
  # slots whose GPU groups meet share those GPUs: their servers measure in turns, not at once
  turns=$(tr ' ' '\n' <<<"$slots" | cut -d: -f1 | tr ',' '\n' | sort | uniq -d | head -1)
  stop_leftover_servers
  rm -f /tmp/$prefix-*.log  # an earlier call's, on a machine kept warm
  python3 -m "$module" $args --dry-run >/dev/null  # the model's files, before any server reads them
  for slot in $slots; do
    IFS=: read -r gpus backend rest <<<"$slot"
    if [[ $module == e2e_bench.serve ]]; then
      # the servers measure each point at the same time (a server measured alone, or beside another's
      # start-up, is not comparable: docs/e2e.md, "Host time")
      extra=(--server-sample "${rest:-1}" --lockstep "$stamp:$nslots${turns:+:turns}")
      out=/tmp/qla-split-$i log=/tmp/$prefix-gpu$gpus-$backend.log
    else
      IFS=: read -r phase ks <<<"$rest"
      extra=(--phase "$phase") out=/tmp/$prefix-out-$i log=/tmp/$prefix-${gpus//,/-}-$backend-$phase.log
      if [[ $phase == spec && $ks == *:* ]]; then  # spec:METHOD:K,K...: this slot's proposer (mtp, ngram)
        extra+=(--spec-method "${ks%%:*}") ks=${ks#*:} log=${log%.log}-${extra[-1]}.log
      fi
      [[ $phase != spec ]] || extra+=(--spec-tokens ${ks//,/ } --wait-oracle 900)
      # a stress slot beside its backend's oracle slot compares once that oracle is saved
      [[ $phase != stress || " $slots " != *":$backend:oracle"* ]] || extra+=(--wait-oracle 900)
      [[ $phase != oracle || -z $ks ]] || extra+=(--oracle-shard "$ks")
    fi
    pin=()
    case ${QLA_SPLIT_CPUS:-} in
      '') ;;
      even)
        ((per > 0)) || { echo "QLA_SPLIT_CPUS=even: a CPU per slot at least (${#cpus[@]} CPUs, $nslots slots)"; return 2; }
        pin=(taskset -c "$(IFS=,; echo "${cpus[*]:i * per:per}")") ;;
      local)
        local_cpus=$(python3 -c 'import sys; from e2e_bench.serve import local_cpus_of; print(local_cpus_of(sys.argv[1]))' "$gpus") \
          || { echo "QLA_SPLIT_CPUS=local: no CPUs local to GPUs $gpus"; return 2; }
        pin=(taskset -c "$local_cpus") ;;
      *) echo "QLA_SPLIT_CPUS=$QLA_SPLIT_CPUS: 'even' (an equal share per slot) or 'local' (the CPUs nearest the slot's GPUs)"; return 2 ;;
    esac
    if [[ $module == e2e_bench.stress && " $args " == *" --engine sglang "* ]]; then
      # SGLang sizes its pools from the GPU memory free at its start: a slot sharing GPUs with an
      # earlier one starts once that one's server is up (serve's lockstep does the same for its turns)
      for ((j = 0; j < i; j++)); do
        [[ -n $(comm -12 <(tr ',' '\n' <<<"$gpus" | sort) <(tr ',' '\n' <<<"${slot_gpus[j]}" | sort)) ]] || continue
        echo "slot $i ($slot) starts once slot $j's server is up (GPUs $gpus shared)"
        while ! grep -q "] healthy " "${slot_logs[j]}" 2>/dev/null && kill -0 "${slot_pids[j]}" 2>/dev/null; do sleep 2; done
      done
    fi
    CUDA_VISIBLE_DEVICES=$gpus VLLM_CACHE_ROOT=/tmp/qla-vllm-cache-${gpus//,/-}${turns:+-$i} "${pin[@]}" python3 -m "$module" $args \
      --backends "$backend" "${extra[@]}" --port $((8321 + 100 * i)) --out-dir "$out" >"$log" 2>&1 &
    slot_gpus[i]=$gpus slot_logs[i]=$log slot_pids[i]=$!
    i=$((i + 1))
  done
  for job in $(jobs -p); do wait "$job" || rc=1; done
  for log in /tmp/$prefix-*.log; do echo "-- ${log##*/}"; grep -E "$pattern" "$log" | tail -n "$lines"; done
  if [[ $module == e2e_bench.stress && -z $(tr ' ' '\n' <<<"$slots" | grep -v '^[^:]*:[^:]*:oracle') ]]; then
    echo "oracle slots only: their tokens stay in the work directory for the next call, no results file yet"
  else
    python3 -m "$module" $args --collect --out-dir "$OUT" || rc=$?
  fi
  return $rc
}

# the tests' and check's GPUs when QLA_TEST_GPUS names them, else the call's
test_gpus=(); [[ -z ${QLA_TEST_GPUS:-} ]] || test_gpus=(env CUDA_VISIBLE_DEVICES="$QLA_TEST_GPUS")
status=0
for step in "$@"; do
  echo "== $step"
  case $step in
    tests)
      # one pytest per GPU over an interleaved share of the tests: a 4-GPU machine runs the suite in
      # about a quarter of the time (QLA_TEST_SHARDS=1 keeps one process; more shards than GPUs put
      # several processes on a GPU, shard i on GPU i mod the count: a one-GPU machine's suite is
      # mostly compiles and launches, not GPU time)
      # QLA_TEST_GPUS="2,3": the shards on those GPUs only (the others busy with a server of another step)
      IFS=, read -r -a gpu_ids <<<"${QLA_TEST_GPUS:-$(nvidia-smi -L | awk '{print NR - 1}' | paste -sd,)}"
      gpus=${#gpu_ids[@]}; ((gpus > 0)) || { gpu_ids=(0); gpus=1; }
      shards=${QLA_TEST_SHARDS:-$gpus}
      if ((shards <= 1)); then
        "${test_gpus[@]}" python3 -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" ${QLA_PYTEST_ARGS:-} \
          2>&1 | tee "$OUT/gpu-tests.log" | tail -40
      else
        ( rm -f /tmp/qla-gpu-tests-*  # an earlier call's shards, on a machine kept warm
          python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only ${QLA_PYTEST_ARGS:-} | grep '::' >/tmp/qla-gpu-tests.txt
          echo "$(wc -l </tmp/qla-gpu-tests.txt) tests over $shards processes on $gpus GPUs"
          for ((i = 0; i < shards; i++)); do
            awk -v n="$shards" -v i="$i" '(NR - 1) % n == i' /tmp/qla-gpu-tests.txt >/tmp/qla-gpu-tests-$i.txt
            CUDA_VISIBLE_DEVICES=${gpu_ids[i % gpus]} python3 -m pytest -q -rs -p no:cacheprovider --junitxml="/tmp/qla-gpu-tests-$i.xml" \
              $(cat /tmp/qla-gpu-tests-$i.txt) >/tmp/qla-gpu-tests-$i.log 2>&1 &
          done
          rc=0; for job in $(jobs -p); do wait "$job" || rc=1; done
          for ((i = 0; i < shards; i++)); do echo "-- shard $i (GPU ${gpu_ids[i % gpus]})"; tail -8 /tmp/qla-gpu-tests-$i.log; done
          cat /tmp/qla-gpu-tests-*.log >"$OUT/gpu-tests-shards.log"
          exit $rc ) 2>&1 | tee "$OUT/gpu-tests.log" | tail -60
      fi ;;
    check) "${test_gpus[@]}" python3 -m qla_serving.cli check 2>&1 | tee "$OUT/check.log" ;;
    batch-invariance) python3 -m qla_serving.bench.invariance 2>&1 | tee "$OUT/batch-invariance.txt" ;;
    bench-prefill) python3 -m qla_serving.cli bench prefill --out-dir "$OUT" ${QLA_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-prefill.log" | tail -60 ;;
    bench-decode) python3 -m qla_serving.cli bench decode --out-dir "$OUT" ${QLA_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-decode.log" | tail -60 ;;
    profile-prefill)
      ( rc=0
        for cell in "2-8:2/8:1x8192:qla-nocp" "16-64:16/64:8x4096:qla"; do
          IFS=: read -r name heads batch impl <<<"$cell"
          rep=/tmp/qla-profile-$name
          ncu --target-processes all -k "regex:chunk_fwd|prep" -c 2 --set full --import-source yes -f -o "$rep" \
            python3 -m qla_serving.cli bench prefill --impls "$impl" --heads "$heads" --batches "$batch" \
              --modes eager --iters 3 --out-dir /tmp/qla-profile-bench >"$OUT/profile-$name-run.log" 2>&1 || rc=1
          ncu -i "$rep.ncu-rep" --page details >"$OUT/profile-$name-details.txt" 2>&1 || rc=1
          ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -6 >"$OUT/profile-$name-sass.csv.xz"
          python3 "$here/scripts/ncu_hot.py" "$OUT/profile-$name-sass.csv.xz" --top 30 >"$OUT/profile-$name-hot.txt" 2>&1
          head -12 "$OUT/profile-$name-hot.txt"
          tail -3 "$OUT/profile-$name-run.log"; grep -E "^  [a-z_]+_kernel|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible" "$OUT/profile-$name-details.txt" | head -30
        done
        # one archive instead of four files per cell: the lent machine returns few files per call
        tar -C "$OUT" -cJf "$OUT/profile-prefill.tar.xz" --remove-files \
          $(cd "$OUT" && ls profile-*-details.txt profile-*-sass.csv.xz profile-*-hot.txt profile-*-run.log 2>/dev/null)
        exit $rc ) 2>&1 | tee "$OUT/profile-prefill.log" | tail -80 ;;
    serve)
      ( rc=0
        stop_leftover_servers
        python3 -m e2e_bench.serve ${QLA_SERVE_ARGS:-} --out-dir "$OUT" || rc=$?
        tar -C /tmp --exclude='*/model' --exclude='*/trace-*' -cJf "$OUT/serve-logs.tar.xz" \
          $(cd /tmp && ls -d qla-serve-* 2>/dev/null)
        exit $rc ) 2>&1 | tee "$OUT/serve.log" | tail -60 ;;
    serve-split)
      ( side_by_side e2e_bench.serve "${QLA_SERVE_ARGS:-}" "${QLA_SERVE_SPLIT:?GPU:BACKEND[:SAMPLE] ...}" \
          qla-serve-split "CPUs|lockstep|healthy|warm-up|point|FAILED|budget"
        rc=$?
        tar -C /tmp --exclude='*/model' --exclude='*/trace-*' -cJf "$OUT/serve-logs.tar.xz" \
          $(cd /tmp && ls -d qla-serve-* 2>/dev/null)
        exit $rc ) 2>&1 | tee "$OUT/serve.log" | tail -60 ;;
    stress-split)
      ( side_by_side e2e_bench.stress "${QLA_STRESS_ARGS:-}" "${QLA_STRESS_SPLIT:?GPUS:BACKEND:PHASE[:K,K...] ...}" \
          qla-stress-split "healthy|oracle|FAILED|died|budget|: [0-9]+ of" 12
        rc=$?
        tar -C /tmp --exclude='*/model' -cJf "$OUT/stress-logs.tar.xz" $(cd /tmp && ls -d qla-stress-* 2>/dev/null)
        exit $rc ) 2>&1 | tee "$OUT/stress.log" | tail -60 ;;
    install)
      # the package from its built wheel (QLA_WHEEL, a path in the checkout), not the staged tree,
      # run from a directory that holds only the harness, so the checkout cannot stand in for it
      # QLA_DOCKERFILE: installed by that Dockerfile's own pip line into a fresh environment over the
      # image's packages and the bundles (scripts/docker_replay.sh, offline), and served through it
      ( rm -rf /tmp/qla-wheel /tmp/qla-bench && mkdir -p /tmp/qla-bench && cp -r e2e_bench /tmp/qla-bench/
        wheel=${QLA_WHEEL:?the built wheel}; [[ $wheel == /* ]] || wheel=$here/$wheel
        export PYTHONPATH=${PYTHONPATH#"$QLA_STAGE":} && unset QLA_KERNEL_LIBRARY
        # bundles go on sys.path in the order they were loaded: the engine's pins (QLA_PIN_BUNDLE, lib folders,
        # colon-separated) must come before the test bundle's TileLang 0.1.15
        [[ -z ${QLA_PIN_BUNDLE:-} ]] || export QLA_BUNDLES=$QLA_PIN_BUNDLE:$QLA_BUNDLES
        py=python3
        if [[ -n ${QLA_DOCKERFILE:-} ]]; then
          QLA_REPLAY_OFFLINE=1 QLA_DIST_DIR=$(dirname "$wheel") bash "$here/scripts/docker_replay.sh" "$QLA_DOCKERFILE" /tmp/qla-replay || exit 1
          py=/tmp/qla-replay/bin/python
        else
          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/qla-wheel "$wheel" || exit 1
          export PYTHONPATH=/tmp/qla-wheel:$PYTHONPATH
        fi
        cd /tmp/qla-bench
        $py -c "import tilelang, qla_serving; print('tilelang', tilelang.__version__, 'qla_serving from', qla_serving.__file__)"
        $py -m e2e_bench.install ${QLA_INSTALL_ARGS:-} --out-dir "$OUT"
        rc=$?; tar -C /tmp -cJf "$OUT/install-logs.tar.xz" $(cd /tmp && ls -d qla-install/server-*.log 2>/dev/null); exit $rc
      ) 2>&1 | tee "$OUT/install.log" | tail -40 ;;
    stress)
      ( rc=0
        stop_leftover_servers
        python3 -m e2e_bench.stress ${QLA_STRESS_ARGS:-} --out-dir "$OUT" || rc=$?
        tar -C /tmp --exclude='*/model' -cJf "$OUT/stress-logs.tar.xz" $(cd /tmp && ls -d qla-stress-* 2>/dev/null)
        exit $rc ) 2>&1 | tee "$OUT/stress.log" | tail -60 ;;
    stress-runs)
      # stress runs side by side, run i on GPU i, each in a work directory of its own (their rows share
      # a name) with the common QLA_STRESS_ARGS and its own part of QLA_STRESS_RUNS="ARGS0|ARGS1|..."
      # (another batching of the same requests against the same oracle: --load-send ..., or another
      # of our backends); an oracle carried in .device/stress-oracle/oracle.tar.xz goes into each
      # first (the harness's --oracle-as FROM:TO lets backend TO answer against FROM's oracle, where
      # alone they answer alike). Results in $OUT/s0, $OUT/s1, ..., packed at the end
      ( stop_leftover_servers
        IFS='|' read -r -a parts <<<"${QLA_STRESS_RUNS:?ARGS0|ARGS1|...}"
        work=${QLA_STRESS_RUNS_DIR:-/tmp/qla-stress-run}
        for i in "${!parts[@]}"; do
          mkdir -p "$work-$i" "$OUT/s$i"
          [[ ! -f $here/.device/stress-oracle/oracle.tar.xz ]] || tar -C "$work-$i" -xJf "$here/.device/stress-oracle/oracle.tar.xz"
          CUDA_VISIBLE_DEVICES=$i VLLM_CACHE_ROOT=/tmp/qla-vllm-cache-$i python3 -m e2e_bench.stress ${QLA_STRESS_ARGS:-} ${parts[i]} \
            --work-dir "$work-$i" --port $((8321 + 100 * i)) --out-dir "$OUT/s$i" >"$OUT/s$i/stress.log" 2>&1 &
        done
        rc=0; for job in $(jobs -p); do wait "$job" || rc=1; done
        grep -hE "healthy|oracle|load:|wrote|FAILED|died|budget|rror" "$OUT"/s*/stress.log | cut -c1-300
        # every run's results and progress in one archive: a call returns at most eight files
        (cd "$OUT" && tar -cJf stress-runs-results.tar.xz --remove-files s*/) || rc=1
        logs=$(cd "$(dirname "$work")" && ls "${work##*/}"-*/*.log 2>/dev/null)
        [[ -z $logs ]] || tar -C "$(dirname "$work")" -cJf "$OUT/stress-runs-logs.tar.xz" $logs
        exit $rc ) 2>&1 | tee "$OUT/stress-runs.log" | tail -40 ;;
    caches-save)
      # the JIT caches a cold start fills (Triton's: vLLM's and FLA's kernels; FlashInfer's: its JIT
      # modules, e.g. SGLang's all-reduce fusion at TP > 1), back in pieces a call can return, so that
      # the next machine starts warm (caches-restore); what is older than the image's versions is
      # simply not hit there
      ( dirs=(); for d in "${jit_cache_dirs[@]}"; do [[ -d $HOME/$d ]] && dirs+=("$d"); done
        ((${#dirs[@]})) || { echo "no JIT cache under $HOME"; exit 1; }
        (cd "$HOME" && du -sh "${dirs[@]}")
        rm -f "$OUT"/jit-caches.*
        tar -C "$HOME" -cf - "${dirs[@]}" | xz -T0 -6 | split -b "${QLA_CACHE_PIECE:-15m}" -d -a 2 - "$OUT/jit-caches.tar.xz."
        n=$(ls "$OUT"/jit-caches.tar.xz.* | wc -l)
        if ((n > ${QLA_CACHE_MAX_PIECES:-5})); then
          echo "the caches make $n pieces, more than a call returns beside its results: not kept"
          rm -f "$OUT"/jit-caches.*; exit 1
        fi
        echo "$n $(date +%Y%m%d%H%M%S)-$RANDOM" >"$OUT/jit-caches.count"  # the pieces, and which save made them
        ls -l "$OUT"/jit-caches.*
        echo "store them with: scripts/device_caches.sh store <the call's files_at>" ) 2>&1 | tee "$OUT/caches-save.log" | tail -12 ;;
    caches-restore)
      # the pieces carried in .device/jit-caches/K (one folder per call: K=1, 2, ... as stored),
      # unpacked into $HOME once all are here
      ( carried=$(ls "$here"/.device/jit-caches/*/jit-caches.count 2>/dev/null | head -1)
        [[ -n $carried ]] || { echo "no .device/jit-caches/K carried in this call"; exit 1; }
        read -r n stamp <"$carried"
        pieces=${QLA_JIT_PIECES:-/tmp/qla-jit-pieces}/$stamp  # one save's pieces, kept across calls
        mkdir -p "$pieces" && cp -n "$here"/.device/jit-caches/*/jit-caches.tar.xz.* "$pieces/"
        have=$(ls "$pieces"/jit-caches.tar.xz.* | wc -l)
        if ((have < n)); then echo "JIT caches: $have of $n pieces here, carry the rest in the next call"; exit 0; fi
        cat "$pieces"/jit-caches.tar.xz.* | xz -d | tar -C "$HOME" -xf - || exit 1
        echo "JIT caches restored into $HOME:" $(cd "$HOME" && du -sh "${jit_cache_dirs[@]}" 2>/dev/null)
      ) 2>&1 | tee "$OUT/caches-restore.log" | tail -5 ;;
    library)
      ( out=${QLA_LIBRARY_OUT:-/tmp/qla-lib} start=$(date +%s)
        python3 -m qla_serving.cli compile --shipped --out "$out" --jobs "$(nproc)" 2>&1 | tr '\r' '\n' \
          | grep -v -E "begins to compile|completes to compile|building kernels: +[0-9]+%" | tail -5
        [[ -f $out/manifest.json ]] || exit 1
        echo "library built in $(($(date +%s) - start)) s:"
        library_summary "$out" "the sources"
        tar -C "$out" -cf - . | xz -T0 -6 | split -b 15M -d - "$OUT/qla-lib.tar.xz." && ls -l "$OUT"/qla-lib.tar.xz.*
      ) 2>&1 | tee "$OUT/library.log" | tail -12 ;;
    library-from-wheel)
      ( wheel=${QLA_WHEEL:?the built wheel}; [[ $wheel == /* ]] || wheel=$here/$wheel
        out=${QLA_LIBRARY_OUT:-/tmp/qla-lib}
        dist=${QLA_DIST_DIR:-/tmp/qla-dist}
        mkdir -p "$out" "$dist" && cp "$wheel" "$dist/" || exit 1
        python3 - "$wheel" "$out" <<'PY' || exit 1
import pathlib, sys, zipfile
wheel, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    members = [n for n in z.namelist() if "/kernels/shipped/" in n and not n.endswith("/")]
    if not any(n.endswith("/manifest.json") for n in members):
        sys.exit(f"{wheel.name}: no kernels/shipped/manifest.json in it (a wheel built without the library)")
    for n in members:
        (out / n.rsplit("/", 1)[1]).write_bytes(z.read(n))
PY
        library_summary "$out" "$(basename "$wheel")"
      ) 2>&1 | tee "$OUT/library.log" | tail -6 ;;
    tests-background)
      rm -rf /tmp/qla-suite-out /tmp/qla-suite.rc
      setsid nohup bash -c 'OUT=/tmp/qla-suite-out QLA_STAGE=/tmp/qla-stage-suite bash "$1" tests check \
        >/tmp/qla-suite.log 2>&1; echo $? >/tmp/qla-suite.rc' _ "$here/scripts/gpu_session.sh" \
        </dev/null >/dev/null 2>&1 &
      echo "GPU suite started in the background (log /tmp/qla-suite.log; collect it with tests-wait)" ;;
    tests-wait)
      ( waited=0
        while [[ ! -f /tmp/qla-suite.rc ]] && ((waited < ${QLA_SUITE_WAIT:-600})); do sleep 5; waited=$((waited + 5)); done
        [[ -f /tmp/qla-suite.rc ]] || { echo "the background suite is still running after ${waited} s"; tail -5 /tmp/qla-suite.log; exit 1; }
        echo "background suite: status $(cat /tmp/qla-suite.rc), waited ${waited} s"
        grep -E "tests over|passed|failed|error" /tmp/qla-suite.log | tail -12
        tar -C /tmp/qla-suite-out -cJf "$OUT/gpu-tests.tar.xz" . && exit "$(cat /tmp/qla-suite.rc)"
      ) 2>&1 | tee "$OUT/gpu-tests-wait.log" | tail -20 ;;
    *) echo "unknown step $step"; status=2 ;;
  esac
  rc=${PIPESTATUS[0]}
  ((rc == 0)) || { echo "step $step failed with $rc"; status=1; }
done
exit $status
