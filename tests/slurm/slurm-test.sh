#!/usr/bin/env bash
# A real one-node Slurm on this machine: start munged, slurmctld and slurmd, submit the
# templates train.sbatch (once through, once stopped by USR1 mid-run, requeued and resumed to
# the same digest) and pytest.sbatch with small sizes through `sbatch --wait`, check their
# exit codes and output; check train-gpu.sbatch with `sbatch --test-only` against two GPUs
# that the node declares (stand-in device files: this machine has none), then run it with
# DEVICE=cpu; stop what was started. Fails loudly when a step cannot run.
# Usage: tests/slurm/slurm-test.sh VENV   (run from the repository root, as root)
set -euo pipefail
venv=$(realpath "${1:?usage: slurm-test.sh VENV}")
fail() { echo "slurm-test: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "needs root, to start munged, slurmctld and slurmd"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  echo "slurm-test: installing Debian's slurm-wlm and munge"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
    >/dev/null || fail "cannot install slurm-wlm and munge with apt-get"
fi

work=$(mktemp -d /tmp/slurm-test.XXXXXX)
chmod 755 "$work"
export SLURM_CONF=$work/slurm.conf
started=()
stop() {
  for pid_file in "${started[@]}"; do
    [ -f "$pid_file" ] && kill "$(cat "$pid_file")" 2>/dev/null || true
  done
  sleep 1
}
trap stop EXIT

# munge: a fresh key, its own socket, pid and log in $work
mkdir -p "$work/munge"
dd if=/dev/urandom bs=1 count=1024 of="$work/munge/munge.key" 2>/dev/null
chown -R munge:munge "$work/munge" 2>/dev/null || true
chmod 755 "$work/munge"; chmod 400 "$work/munge/munge.key"
socket=$work/munge/munge.socket
runuser -u munge -- munged --key-file="$work/munge/munge.key" --socket="$socket" \
  --pid-file="$work/munge/munged.pid" --log-file="$work/munge/munged.log" --seed-file="$work/munge/seed" \
  || fail "munged did not start: $(cat "$work/munge/munged.log" 2>/dev/null)"
started+=("$work/munge/munged.pid")

host=$(hostname -s)
node="$(slurmd -C | head -n 1) Gres=gpu:2"
mkdir -p "$work/state" "$work/spool"
printf "Name=gpu File=/dev/null\nName=gpu File=/dev/zero\n" > "$work/gres.conf"  # stand-ins
# FirstJobId: job ids unlike those of earlier runs of this script.  With ids from 1 each time,
# steps here failed in MPI_Init ("Message truncated") after a step of the same job id had been
# killed in an earlier run (MPICH leaves shared-memory segments in /dev/shm when killed).
cat > "$SLURM_CONF" <<CONF
ClusterName=tensorplay
FirstJobId=$((RANDOM * 1000 + 1000))
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
GresTypes=gpu
ReturnToService=2
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
$node
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
slurmctld -f "$SLURM_CONF" || fail "slurmctld did not start: $(tail -5 "$work/slurmctld.log")"
started+=("$work/slurmctld.pid")
slurmd -f "$SLURM_CONF" || fail "slurmd did not start: $(tail -5 "$work/slurmd.log")"
started+=("$work/slurmd.pid")
for _ in $(seq 30); do
  sinfo -h -o %T 2>/dev/null | grep -q idle && break
  sleep 1
done
sinfo -h -o %T | grep -q idle || fail "the node never became idle: $(sinfo 2>&1; tail -5 "$work/slurmd.log")"

submit() {  # submit TEMPLATE OUTPUT [sbatch options]: sbatch --wait, then show the output
  local template=$1 out=$2; shift 2
  local rc=0
  timeout 300 sbatch --wait --output="$out" "$@" "$template" >/dev/null || rc=$?
  echo "--- $template (exit $rc)"; cat "$out"
  return $rc
}

# The one edit a site makes: its account and partition (here, on the command line).
site=(--account=tensorplay --partition=debug)
export VENV=$venv EPOCHS=30 TESTS=tests/algorithms/test_join.py
CHECKPOINT=$work/checkpoint-plain submit slurm/train.sbatch "$work/train.out" "${site[@]}" \
  --ntasks-per-node=2 || fail "train.sbatch failed"
digest=$(grep -o "parameters identical on all 2 ranks: yes (digest [0-9a-f]*)" "$work/train.out") \
  || fail "train.sbatch did not confirm identical parameters on 2 ranks"

# The stop loop (docs/stopping.md): USR1 to the batch script mid-run, as --signal=B:USR1@T
# sends it before the time limit; the script forwards it to the tasks, which stop at one
# iteration and write a checkpoint; it requeues the job, which resumes and must end with the
# digest of the run never stopped above.
wait_for() {  # wait_for SECONDS COMMAND...: until COMMAND succeeds, at most SECONDS
  local deadline=$((SECONDS + $1)); shift
  until "$@" 2>/dev/null; do [ "$SECONDS" -lt "$deadline" ] || return 1; sleep 0.2; done
}
state() { scontrol show job "$1" | grep -o "JobState=[A-Z_]*" | cut -d= -f2; }
ended() { case $(state "$1") in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) ;;
          *) return 1 ;; esac; }
loop=$work/train-stop.out
jid=$(CHECKPOINT=$work/checkpoint-stop sbatch --parsable --output="$loop" "${site[@]}" \
  --ntasks-per-node=2 slurm/train.sbatch) || fail "sbatch train.sbatch (stop loop) failed"
started() { grep -q "training samples split" "$loop" || ended "$1"; }
wait_for 120 started "$jid" && grep -q "training samples split" "$loop" \
  || fail "the job did not start training: $(cat "$loop")"
scancel --batch --signal=USR1 "$jid"
wait_for 60 grep -q "requeueing job $jid" "$loop" || fail "no stop and requeue: $(cat "$loop")"
requeued() { [ "$(state "$1")" = PENDING ]; }  # asked again at each try, not once
wait_for 30 requeued "$jid" || fail "job $jid was not requeued: $(state "$jid")"
# Slurm holds a requeued job back about 2 minutes (its BeginTime); the test skips most of that
# (slurmd refused a relaunch within a second of the requeue: "Job already killed")
sleep 5
scontrol update JobId="$jid" StartTime=now
wait_for 180 ended "$jid" || fail "the requeued job did not end: $(cat "$loop")"
echo "--- slurm/train.sbatch, USR1 mid-run, requeued ($(state "$jid"))"; cat "$loop"
[ "$(state "$jid")" = COMPLETED ] || fail "the requeued job ended $(state "$jid")"
grep -q "stopped by SIGUSR1 at epoch" "$loop" || fail "the job did not stop on SIGUSR1"
grep -q "^run 2 of job $jid" "$loop" || fail "job $jid did not run a second time"
grep -q "resumed from $work/checkpoint-stop/checkpoint.npz: epoch" "$loop" \
  || fail "the requeued job did not resume from its checkpoint"
grep -qF "$digest" "$loop" || fail "the resumed job did not end with the digest of the run never \
stopped ($digest)"
submit slurm/pytest.sbatch "$work/pytest.out" "${site[@]}" --ntasks=2 || fail "pytest.sbatch failed"
grep -Eq "^[0-9]+ passed" "$work/pytest.out" || fail "pytest.sbatch ran no test"
! grep -q "failed" "$work/pytest.out" || fail "pytest.sbatch had failures"
# The GPU template, scaled to this node (2 tasks, a core each): Slurm accepts its GPU request
# without running it (--test-only); then it runs, a declared GPU per task, with DEVICE=cpu.
gpu_site=(--account=tensorplay --partition=debug)
timeout 60 sbatch --test-only "${gpu_site[@]}" --ntasks-per-node=2 --cpus-per-task=1 \
  slurm/train-gpu.sbatch 2>&1 | tee "$work/gpu-test-only.out"
grep -q "to start at" "$work/gpu-test-only.out" || fail "sbatch --test-only refused train-gpu.sbatch"
DEVICE=cpu submit slurm/train-gpu.sbatch "$work/train-gpu.out" "${gpu_site[@]}" \
  --ntasks-per-node=2 --cpus-per-task=1 || fail "train-gpu.sbatch (DEVICE=cpu) failed"
grep -q "parameters identical on all 2 ranks: yes" "$work/train-gpu.out" \
  || fail "train-gpu.sbatch did not confirm identical parameters on 2 ranks"
grep -q "BLAS/OpenMP threads: kept (OMP_NUM_THREADS=1 set by the user)" "$work/train-gpu.out" \
  || fail "train-gpu.sbatch: info did not show the OMP_NUM_THREADS the template sets"
# the wrong plugin starts every task as a singleton: the library must say so
wrong=$(timeout 120 srun --mpi=none --ntasks=2 "$venv/bin/python" -m mpi4py -c \
  "import numpy; from tensorplay_mpi import DataParallel; DataParallel([numpy.zeros(2)])" 2>&1) \
  && fail "srun --mpi=none did not fail: $wrong"
grep -q "SLURM_STEP_NUM_TASKS=2" <<<"$wrong" && grep -q "srun --mpi=pmi2" <<<"$wrong" \
  || fail "srun --mpi=none did not give the launch error: $wrong"
echo "slurm-test: train.sbatch, its stop loop (USR1, checkpoint, requeue, exact resume),"
echo "slurm-test: pytest.sbatch and train-gpu.sbatch (--test-only, then DEVICE=cpu)"
echo "slurm-test: passed on a real Slurm ($(sinfo -V)); the wrong --mpi plugin gave the launch error"
