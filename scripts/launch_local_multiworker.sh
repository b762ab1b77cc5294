#!/usr/bin/env bash
# Starts N training workers on this machine under MultiWorkerMirroredStrategy, the way workers are started on
# separate machines: one process per worker, each with a TF_CONFIG naming the whole cluster and its own index.
#
#   scripts/launch_local_multiworker.sh N [arguments of python -m txl_tf.train ...]
#   scripts/launch_local_multiworker.sh 2 --gin_file=gin/sample.gin --model_dir=runs/sample_mw
#
# Workers listen on free loopback ports. Worker 0 is the chief (checkpoints, config.gin, TensorBoard in
# --model_dir); the others write into temporary folders inside it that are removed at the end. Output lines are
# prefixed with [worker i]. SIGTERM / SIGINT are forwarded to every worker (they save a checkpoint and exit);
# when a worker fails the others are stopped, and the script exits with the first failing worker's status.
# A worker that has not ended STOP_GRACE_S seconds (default 120) after a stop request (a hung or stopped process
# never handles SIGTERM) is killed with SIGKILL, and the script exits non-zero.
# Keep STOP_GRACE_S above the coordination service's heartbeat timeout (about 10 s): a worker blocked on a
# killed peer learns of the loss only from that timeout, and then ends itself with one line naming the peer.
# Across machines: set TF_CONFIG on each machine yourself (same cluster list, task index = machine number) and
# run `python -m txl_tf.train --strategy=multi_worker_mirrored ...` there.
set -uo pipefail

if [[ $# -lt 1 || ! "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_WORKERS [python -m txl_tf.train arguments...]" >&2
  exit 2
fi
num_workers=$1
shift
python=${PYTHON:-python3}
repo_root=$(cd "$(dirname "$0")/.." && pwd)

# One free loopback port per worker (kept open together so they differ, then released for the workers).
ports=$("$python" - "$num_workers" <<'EOF'
import socket, sys
sockets = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in sockets:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in sockets))
for s in sockets:
    s.close()
EOF
) || { echo "could not find free ports with $python" >&2; exit 1; }

workers=""
for port in $ports; do
  workers+="${workers:+,}\"127.0.0.1:$port\""
done

grace=${STOP_GRACE_S:-120}
[[ $grace =~ ^[0-9]+$ ]] || { echo "STOP_GRACE_S=$grace must be a number of seconds" >&2; exit 2; }
pids=()
stop_requested_at=""
killed=""
cleanup() {
  [[ -z $stop_requested_at ]] && stop_requested_at=$SECONDS
  for pid in "${pids[@]}"; do
    [[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null
  done
}
trap 'echo "forwarding the stop request to ${#pids[@]} workers" >&2; cleanup' TERM INT

for ((i = 0; i < num_workers; i++)); do
  tf_config="{\"cluster\": {\"worker\": [$workers]}, \"task\": {\"type\": \"worker\", \"index\": $i}}"
  TF_CONFIG=$tf_config PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    "$python" -m txl_tf.train --strategy=multi_worker_mirrored "$@" \
    > >(sed -u "s/^/[worker $i] /") 2>&1 &
  pids+=($!)
done
echo "started $num_workers workers on 127.0.0.1 ports $ports (pids ${pids[*]})" >&2

# Poll the workers (bash records each one's exit status when it ends); a trapped signal does not end the loop.
status=0
while :; do
  alive=0
  for index in "${!pids[@]}"; do
    pid=${pids[$index]}
    [[ -z $pid ]] && continue
    if kill -0 "$pid" 2>/dev/null; then
      alive=$((alive + 1))
      continue
    fi
    wait "$pid"
    code=$?
    pids[$index]=""
    if ((code != 0 && status == 0)); then
      status=$code
      echo "worker $index exited with status $code; stopping the others" >&2
      cleanup
    fi
  done
  ((alive == 0)) && break
  if [[ -n $stop_requested_at && -z $killed ]] && ((SECONDS - stop_requested_at >= grace)); then
    killed=1
    for index in "${!pids[@]}"; do
      [[ -z ${pids[$index]} ]] && continue
      echo "worker $index did not stop within ${grace} s (STOP_GRACE_S) of the stop request; killing it" >&2
      kill -KILL "${pids[$index]}" 2>/dev/null
      ((status == 0)) && status=1
    done
  fi
  sleep 0.5
done
wait  # the output filters
exit $status
