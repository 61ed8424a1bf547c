# Sourced by the runners' poll.sh on the GPU host: wait while the job runs, and never for a
# job that is not there. A launch the `run` tool refused (e.g. a carry over 64 MiB) or a
# run.sh that died leaves no live process: the poll then returns at once with exit 3 instead
# of sleeping out its 540 s (the eighth session lost its whole device budget to three polls
# of a job that never started).
#   . experiments/poll-lib.sh; wait_for "$RES" 540 step_done; rc=$?
# run.sh writes its pid to RES/pid as its first act; RES/DONE marks a finished job.

job_alive() { [ -f "$1/pid" ] && kill -0 "$(cat "$1/pid" 2>/dev/null)" 2>/dev/null; }

# wait_for RES SECONDS CHECK...: until CHECK succeeds (0), SECONDS pass (1), or no job is
# running (3: never launched here, or gone without DONE)
wait_for() {
  local res=$1 t=$2 t0; t0=$(date +%s); shift 2
  # a job launched in this same call may take a moment to write its pid
  while [ ! -f "$res/pid" ] && [ ! -f "$res/DONE" ] && [ $(( $(date +%s) - t0 )) -lt 15 ]; do sleep 1; done
  while ! "$@"; do
    if ! job_alive "$res"; then
      "$@" && return 0
      echo "NO JOB RUNNING: $res has $([ -f "$res/pid" ] && echo "a pid file but the process is gone" || echo "no pid file: run.sh never started here") and no DONE; polling again would only burn device time"
      return 3
    fi
    [ $(( $(date +%s) - t0 )) -ge "$t" ] && return 1
    sleep 5
  done
}
