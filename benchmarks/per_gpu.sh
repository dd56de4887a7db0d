#!/usr/bin/env bash
# Run one command per GPU of this host, side by side, each on its own GPU and its own share of the
# CPU cores (so one job's compiling does not slow another's kernel launches), then wait for all.
#
#     bash benchmarks/per_gpu.sh LOGDIR "cmd for GPU 0" "cmd for GPU 1" ...
#
# Each command's output goes to LOGDIR/gpuN.log and its exit status to LOGDIR/gpuN.rc. Rows measured
# by different jobs are not compared with each other: each job's same-run table stands alone.
set -u
logdir=$1; shift
mkdir -p "$logdir"
n=$#
cores=$(nproc)
share=$(( cores / n ))
i=0
for cmd in "$@"; do
    first=$(( i * share )); last=$(( first + share - 1 ))
    pin=""
    command -v taskset >/dev/null && pin="taskset -c $first-$last"
    ( CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$share $pin bash -c "$cmd" > "$logdir/gpu$i.log" 2>&1
      echo $? > "$logdir/gpu$i.rc" ) &
    i=$(( i + 1 ))
done
wait
