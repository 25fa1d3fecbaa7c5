#!/usr/bin/env bash
# The CPU image for real, with podman (rootful, the runc runtime): build it from the Dockerfile on
# a Debian base made here, then
#   1. one container: `llmtrain info` as the non-root user; a tiny run writing to a mounted
#      volume; `podman stop` (SIGTERM) gives exit 75 and a checkpoint, and the same `podman run`
#      resumes it, every step logged once;
#   2. two nodes: two containers on one podman network, ssh keys as podman secrets, the second
#      running llmtrain-sshd; mpirun from the first, with a hostfile, starts 2 ranks on each node,
#      talking over TCP; data-parallel and tensor-parallel (tensor groups inside a node) training
#      give the one-process loss curve within 1e-5 and write one checkpoint;
#   3. a node lost (`podman kill` of the second node) and 4. a network cut (`podman network
#      disconnect` of it), each mid-run under scripts/launch/mpirun.sh --max-restarts 1: the first
#      node's ranks stop within dist.timeout_s, each naming the lost ranks and their host (after a
#      kill, Open MPI may end them first, seeing the peer's sockets close: then mpirun.sh names
#      the host), the job ends with exit 76 within a bounded grace period, and the launcher
#      relaunches on the first node alone (2 ranks, another mesh), which resumes from the last
#      checkpoint and finishes: every step logged once, every checkpoint verifies.
# The base root file system (debootstrap --variant=minbase) is cached by date in
# LLMTRAIN_CONTAINER_CACHE (default ~/.cache/llmtrain-container) and imported as
# localhost/llmtrain-base:SUITE-DATE; the Debian mirror is LLMTRAIN_DEBIAN_MIRROR, else the one
# apt uses here. Network traffic goes only to the containers and the network made here (and the
# mirror, for the base and the image's packages). Prints "SKIPPED: why" and exits 77 where podman
# (as root) cannot run. About 4 minutes on 2 cores, 2 of them building the image (less if podman has
# its layers from an earlier build). LLMTRAIN_CONTAINER_IMAGE=NAME tests an image built before
# instead of building; LLMTRAIN_CONTAINER_CASES picks cases ("single nodes lost cut").
# Usage: container_test.sh SOURCE_DIR
set -uo pipefail
source_dir=$(cd "${1:-$(dirname "$0")/..}" && pwd)
suite="${LLMTRAIN_DEBIAN_SUITE:-bookworm}"
skip() { echo "SKIPPED: $*"; exit 77; }
passed=0
pass() { echo "ok: $*"; passed=$((passed + 1)); }
fail() { echo "FAILED: $*"; echo "$passed passed, 1 failed"; exit 1; }

[[ "$(id -u)" -eq 0 ]] || skip "the container test runs podman as root"
command -v podman >/dev/null || skip "no podman (scripts/setup.sh installs podman, runc and debootstrap)"
command -v runc >/dev/null || skip "no runc (scripts/setup.sh installs it)"
work=$(mktemp -d "${TMPDIR:-/tmp}/llmtrain-container.XXXXXX")
chmod 755 "$work"
# podman's default ulimits cannot always be set (unprivileged build machines); crun may fail on
# its cgroup setup where runc works.
cat >"$work/containers.conf" <<'EOF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$work/containers.conf"
name="llmtrain-test-$$"
net="$name-net"
subnet_prefix="10.89.$((200 + $$ % 50))"
# One name per `podman rm`: given several, podman 4.3 removes none when one is missing.
remove() { local c; for c in "$@"; do podman rm -f -t 0 "$c" >/dev/null 2>&1; done; }
cleanup() {
  remove "$name-single" "$name-node1" "$name-node2"
  podman network rm -f "$net" >/dev/null 2>&1
  podman secret rm "$name-key" "$name-auth" >/dev/null 2>&1
  [[ -n "${LLMTRAIN_CONTAINER_KEEP:-}" ]] && echo "kept: $work" || rm -rf "$work"
}
trap cleanup EXIT
podman info >/dev/null 2>&1 || skip "podman does not work here: $(podman info 2>&1 | tail -n 1)"

# --- the base image: Debian $suite by debootstrap, cached by date ---
base="localhost/llmtrain-base:$suite-$(date +%Y%m%d)"
if ! podman image exists "$base"; then
  cache="${LLMTRAIN_CONTAINER_CACHE:-$HOME/.cache/llmtrain-container}"
  tarball="$cache/debian-$suite-$(date +%Y%m%d).tar"
  mkdir -p "$cache"
  if [[ ! -s "$tarball" ]]; then
    command -v debootstrap >/dev/null || skip "no debootstrap to make the base image (scripts/setup.sh installs it)"
    mirror="${LLMTRAIN_DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 2>/dev/null |
      awk '$1 ~ /\/debian\/?$/ && $2 !~ /-/ {print $1; exit}')}"
    mirror="${mirror:-http://deb.debian.org/debian}"
    echo "base: debootstrap --variant=minbase $suite from $mirror"
    start=$(date +%s)
    debootstrap --variant=minbase "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
      fail "debootstrap $suite $mirror: $(tail -n 3 "$work/debootstrap.log")"
    tar -C "$work/rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball" || fail "cannot write $tarball"
    rm -rf "$work/rootfs"
    find "$cache" -name "debian-$suite-*.tar" ! -name "$(basename "$tarball")" -delete
    echo "base: made in $(($(date +%s) - start)) s"
  fi
  podman import "$tarball" "$base" >/dev/null 2>&1 || fail "podman import $tarball"
fi

# --- the CPU image (LLMTRAIN_CONTAINER_IMAGE: test that image instead) ---
image="${LLMTRAIN_CONTAINER_IMAGE:-}"
if [[ -z "$image" ]]; then
  image="localhost/llmtrain-cpu:test"
  start=$(date +%s)
  podman build -t "$image" --build-arg BUILD_IMAGE="$base" --build-arg RUNTIME_IMAGE="$base" \
    --build-arg LLMTRAIN_CUDA=OFF --build-arg MPI_LIBRARY=libopenmpi3 "$source_dir" >"$work/build.log" 2>&1 ||
    fail "podman build: $(tail -n 20 "$work/build.log")"
  pass "CPU image built from the Dockerfile in $(($(date +%s) - start)) s (base $base)"
fi

# --- 1. one container ---
vol="$work/vol"
mkdir -p "$vol" && chown 1000:1000 "$vol"
out=$(podman run --rm "$image" info 2>&1) || fail "llmtrain info: $out"
user=$(podman run --rm --entrypoint id "$image" -un 2>&1)
[[ "$user" == llmtrain && "$(podman run --rm --entrypoint id "$image" -u)" == 1000 ]] || fail "the image runs as '$user', not llmtrain (uid 1000)"
pass "llmtrain info runs as the non-root user $user: $(head -n 1 <<<"$out")"

for i in $(seq 1 400); do printf 'the quick brown fox %d jumps over the lazy dog\n' "$i"; done >"$vol/text.txt"
chown 1000:1000 "$vol/text.txt"
run_in() { podman run --rm -v "$vol:/work" -e OMP_NUM_THREADS=1 "$@"; }
run_in "$image" tokenize --input /work/text.txt --output /work/data >/dev/null 2>"$work/tokenize.log" ||
  fail "tokenize in the container: $(cat "$work/tokenize.log")"
# config NAME MAX_STEPS EVERY [DIST]: a 1-layer model, 4 samples per update.
config() {
  cat >"$vol/$1.json" <<JSON
{"model": {"vocab_size": 256, "context_length": 16, "n_layer": 1, "n_head": 2, "d_model": 32},
 "data": {"train": "/work/data/train_*.bin"},
 "train": {"micro_batch_size": 1, "global_batch_size": 4, "max_steps": $2, "log_every": 1},
 "optim": {"warmup_steps": 0},
 "checkpoint": {"every": $3, "keep_last": 2},
 "dist": {${4:-}}}
JSON
}
# Training steps of RUN (checkpoint records carry a step too), and their losses.
steps() { grep '"loss":' "$vol/$1/metrics.jsonl" 2>/dev/null | grep -o '"step":[0-9]*' | cut -d: -f2; }
losses() { grep '"loss":' "$vol/$1/metrics.jsonl" | sed -E 's/.*"loss":([-0-9.eE+]+).*"step":([0-9]+).*/\2 \1/'; }
every_step_once() {  # RUN MAX_STEPS
  [[ "$(steps "$1" | tr '\n' ' ')" == "$(seq 1 "$2" | tr '\n' ' ')" ]]
}
wait_for_step() {  # RUN STEP TIMEOUT_S
  local deadline=$(($(date +%s) + $3))
  while (($(date +%s) < deadline)); do
    (($(steps "$1" | tail -n 1 || echo 0) >= $2)) 2>/dev/null && return 0
    sleep 0.2
  done
  return 1
}

# LLMTRAIN_CONTAINER_CASES: which of "single nodes lost cut" to run (default all).
wants() { [[ " ${LLMTRAIN_CONTAINER_CASES:-single nodes lost cut} " == *" $1 "* ]]; }
if wants single; then
config tiny 20 0
run_in "$image" train --config /work/tiny.json --run-dir /work/tiny >"$work/tiny.log" 2>&1 || fail "tiny run: $(tail -n 5 "$work/tiny.log")"
every_step_once tiny 20 && [[ -d "$vol/tiny/checkpoints/step_00000020" ]] ||
  fail "tiny run: steps $(steps tiny | tr '\n' ' '), checkpoints $(ls "$vol/tiny/checkpoints" 2>&1)"
pass "a tiny run writes 20 steps and its checkpoint to the mounted volume"

config stop 6000 0  # long enough that the stop lands mid-run: 600 steps take well under a second
stop_cmd=(podman run --name "$name-single" -v "$vol:/work" -e OMP_NUM_THREADS=1 "$image" train --config /work/stop.json --run-dir /work/stop)
"${stop_cmd[@]}" >"$work/stop1.log" 2>&1 &
wait_for_step stop 30 120 || fail "podman stop case: no step 30 within 120 s: $(tail -n 5 "$work/stop1.log")"
podman stop -t 60 "$name-single" >/dev/null
status=$(podman wait "$name-single" 2>/dev/null || echo "?")
wait
stopped_at=$(steps stop | tail -n 1)
((status == 75)) && ls "$vol/stop/checkpoints" | grep -q "step_0*$stopped_at$" ||
  fail "podman stop: exit $status (want 75), checkpoints $(ls "$vol/stop/checkpoints" 2>&1), last step $stopped_at"
podman rm "$name-single" >/dev/null
"${stop_cmd[@]}" >"$work/stop2.log" 2>&1 || fail "the same podman run after the stop: $(tail -n 5 "$work/stop2.log")"
grep -q "resuming from" "$work/stop2.log" && every_step_once stop 6000 ||
  fail "the rerun did not resume with every step once: $(grep -c . <(steps stop)) step records"
podman rm "$name-single" >/dev/null
pass "podman stop gives exit 75 and a checkpoint at step $stopped_at; the same podman run resumes it, 6000 steps logged once"
fi

# --- 2. two nodes ---
podman network create --subnet "$subnet_prefix.0/24" "$net" >/dev/null || fail "podman network create"
node1_ip="$subnet_prefix.11"
node2_ip="$subnet_prefix.12"
mkdir -p "$work/keys"
podman run --rm -v "$work/keys:/keys" --user 0 --entrypoint ssh-keygen "$image" -q -t ed25519 -N "" -C llmtrain-test -f /keys/id ||
  fail "ssh-keygen"
podman secret create "$name-key" "$work/keys/id" >/dev/null && podman secret create "$name-auth" "$work/keys/id.pub" >/dev/null ||
  fail "podman secret create"
rm -rf "$work/keys"
node_args=(--network "$net" --add-host "node1:$node1_ip" --add-host "node2:$node2_ip" -v "$vol:/work"
  --secret "$name-key,type=mount,target=llmtrain_ssh_key,uid=1000,gid=1000,mode=0400"
  --secret "$name-auth,type=mount,target=llmtrain_authorized_keys,uid=1000,gid=1000,mode=0400")
start_nodes() {
  remove "$name-node1" "$name-node2"
  podman run -d --name "$name-node2" --hostname node2 --ip "$node2_ip" "${node_args[@]}" --entrypoint llmtrain-sshd "$image" >/dev/null &&
    podman run -d --name "$name-node1" --hostname node1 --ip "$node1_ip" "${node_args[@]}" --entrypoint sleep "$image" infinity >/dev/null ||
    fail "starting the two node containers"
  local i
  for i in $(seq 1 50); do
    podman exec "$name-node1" ssh -o BatchMode=yes node2 true 2>/dev/null && return 0
    sleep 0.2
  done
  fail "node1 cannot ssh to node2: $(podman exec "$name-node1" ssh -o BatchMode=yes node2 true 2>&1 | tail -n 2); sshd: $(podman logs "$name-node2" 2>&1 | tail -n 3)"
}
start_nodes
podman image inspect "$image" --format '{{range .History}}{{.CreatedBy}}{{end}}' | grep -q "BEGIN OPENSSH PRIVATE KEY" &&
  fail "a private key in the image's layers"
printf 'node1 slots=2\nnode2 slots=2\n' >"$vol/hosts"
mpi_env=(-e OMP_NUM_THREADS=1 -e OMPI_MCA_btl=tcp,self -e "OMPI_MCA_btl_tcp_if_include=$subnet_prefix.0/24"
  -e "OMPI_MCA_oob_tcp_if_include=$subnet_prefix.0/24")
launch() {  # LAUNCHER-ARGS... -- LLMTRAIN-ARGS...: scripts/launch/mpirun.sh on node1
  podman exec "${mpi_env[@]}" "$name-node1" /opt/llmtrain/launch/mpirun.sh "$@"
}

if wants nodes; then
config curve 30 0
run_in "$image" train --config /work/curve.json --run-dir /work/curve1 >"$work/curve1.log" 2>&1 || fail "one-process run: $(tail -n 5 "$work/curve1.log")"
for layout in "data 4:" "tensor 2:\"tensor_parallel\": 2"; do
  kind="${layout%% *}"
  rest="${layout#* }"
  config "curve-$kind" 30 0 "${rest#*:}"
  launch -n 4 -H /work/hosts -- train --config "/work/curve-$kind.json" --run-dir "/work/curve-$kind" \
    >"$work/curve-$kind.log" 2>&1 || fail "two nodes, $kind parallel: $(tail -n 15 "$work/curve-$kind.log")"
  grep -q "4 rank" "$work/curve-$kind.log" || fail "two nodes, $kind parallel: not 4 ranks: $(grep dist: "$work/curve-$kind.log")"
  diff=$(paste <(losses curve1) <(losses "curve-$kind") | awk '
    {d = $2 - $4; if (d < 0) d = -d; if (d > m) m = d; if ($1 != $3) bad = 1; n++}
    END {if (bad || n != 30) print "mismatch"; else printf "%.3g", m}')
  [[ "$diff" != mismatch ]] && awk -v d="$diff" 'BEGIN {exit !(d <= 1e-5)}' ||
    fail "two nodes, $kind parallel: loss curve differs from one process's by $diff"
  count=$(ls "$vol/curve-$kind/checkpoints" | grep -c '^step_')
  ((count == 1)) || fail "two nodes, $kind parallel: $count checkpoints, want 1"
  [[ -s "$vol/curve-$kind/logs/rank-00003.log" ]] || fail "two nodes: no log from rank 3"
  pass "two nodes, $kind parallel ($(grep -o 'tensor [0-9]* x data [0-9]* x pipeline [0-9]*' "$vol/curve-$kind/logs/rank-00000.log" | head -n 1)): 30 steps, largest loss difference from one process $diff, one checkpoint"
done
fi

# --- 3. and 4. a node lost, a network cut ---
timeout_s=5
grace_s=10
lose_node() {  # CASE HOW: HOW = kill | disconnect
  local case="$1" how="$2" run="lost-$2" max=1500
  start_nodes
  config "$run" "$max" 100 "\"timeout_s\": $timeout_s"
  launch -n 4 -H /work/hosts --max-restarts 1 --min-nodes 1 --grace "$grace_s" -- \
    train --config "/work/$run.json" --run-dir "/work/$run" >"$work/$run.log" 2>&1 &
  local launcher=$! i
  for i in $(seq 1 900); do
    (($(steps "$run" | tail -n 1 || echo 0) >= 250)) 2>/dev/null && break
    kill -0 "$launcher" 2>/dev/null || { wait "$launcher"; fail "$case: the launcher ended (exit $?) before step 250: $(tail -n 5 "$work/$run.log")"; }
    sleep 0.2
  done
  ((i < 900)) || fail "$case: no step 250 within 180 s: $(tail -n 5 "$work/$run.log")"
  # The clock starts when `podman kill` or `podman network disconnect` has returned: the node is
  # surely gone then, while the command itself can take seconds on a loaded machine (the cut takes
  # effect somewhere inside it), and a rank enters its next collective only after the cut.
  local t0 t_cmd t_stop="" t_end="" t_relaunch="" now cmd_s
  t_cmd=$(date +%s.%N)
  if [[ "$how" == kill ]]; then
    podman kill "$name-node2" >/dev/null || fail "podman kill"
  else
    podman network disconnect "$net" "$name-node2" || fail "podman network disconnect"
  fi
  t0=$(date +%s.%N)
  cmd_s=$(awk -v a="$t_cmd" -v b="$t0" 'BEGIN {printf "%.1f", b - a}')
  local deadline=$(($(date +%s) + timeout_s + grace_s + 120))
  while kill -0 "$launcher" 2>/dev/null && (($(date +%s) < deadline)); do
    now=$(date +%s.%N)
    [[ -z "$t_stop" ]] && (($(grep -c "stopping every rank" "$work/$run.log") >= 2)) && t_stop=$now
    [[ -z "$t_end" ]] && grep -q "mpirun.sh: the job lost" "$work/$run.log" && t_end=$now
    [[ -z "$t_relaunch" ]] && grep -q "mpirun.sh: relaunch" "$work/$run.log" && t_relaunch=$now
    sleep 0.2
  done
  if kill -0 "$launcher" 2>/dev/null; then
    podman exec "$name-node1" pkill -KILL -f mpirun >/dev/null 2>&1
    fail "$case: the job still runs $((deadline - ${t0%.*})) s after the node went (hang); last lines: $(tail -n 8 "$work/$run.log")"
  fi
  wait "$launcher"
  local status=$?
  local stop_s end_s relaunch_s how_stopped
  since() { [[ -n "$1" ]] && awk -v a="$t0" -v b="$1" 'BEGIN {printf "%.1f", b - a}' || echo never; }
  stop_s=$(since "$t_stop")
  end_s=$(since "$t_end")
  relaunch_s=$(since "$t_relaunch")
  echo "$case: podman took $cmd_s s; from its return: ranks stopped after $stop_s s, the job ended after $end_s s, relaunched after $relaunch_s s, launcher exit $status"
  grep -E "stopping every rank|mpirun.sh:|ORTE was|unexpectedly disconnected|Peer host" "$work/$run.log" | head -n 8 | sed 's/^/  | /'
  if grep -q "stopping every rank" "$work/$run.log"; then
    [[ -n "$t_stop" ]] || fail "$case: not every surviving rank printed the stop line: $(grep 'stopping every rank' "$work/$run.log")"
    # The stop lines show that the watchdog, not TCP, ended the job; the bound only guards against
    # TCP's own timeouts (many minutes), with room for a machine whose cores are all busy (the
    # cut-off node's ranks spin on the same cores until they too time out).
    awk -v s="$stop_s" -v t="$timeout_s" 'BEGIN {exit !(s <= t + 60)}' ||
      fail "$case: the ranks stopped after $stop_s s, more than dist.timeout_s = $timeout_s s + 60 s"
    local named
    named=$(grep "stopping every rank" "$work/$run.log" | grep -c "2, 3.*node2\|node2.*2, 3")
    ((named >= 2)) || fail "$case: the stop lines do not name ranks 2, 3 and host node2: $(grep 'stopping every rank' "$work/$run.log")"
    how_stopped="ranks 0 and 1 stopped $stop_s s after it (dist.timeout_s $timeout_s), each naming ranks 2, 3 on node2"
  elif [[ "$how" == kill ]] && grep -q "mpirun.sh: host node2 does not answer" "$work/$run.log"; then
    # The killed node's sockets close as its processes die, and Open MPI's TCP transport may then
    # end a rank whose peer hung up before the watchdog's timeout (sometimes with a report naming
    # node2, sometimes silently); mpirun.sh names the lost host either way.
    if grep -q "mpirun.sh: the job lost ranks or a node (connections to node2 closed)" "$work/$run.log"; then
      how_stopped="Open MPI ended ranks 0 and 1 first, its connections to node2 closed (named by it and by mpirun.sh)"
    else
      how_stopped="Open MPI ended ranks 0 and 1 first, without a report; mpirun.sh named node2 as lost"
    fi
  else
    fail "$case: the surviving ranks did not stop naming the lost ranks and host (exit $status): $(grep -E 'error|mpirun.sh:' "$work/$run.log" | tail -n 5)"
  fi
  grep -q "exit 76" "$work/$run.log" || fail "$case: the first job did not end with exit 76: $(grep mpirun.sh: "$work/$run.log")"
  # The bounds: the timeout, the grace, 5 s from mpirun.sh's TERM to its KILL, and room for a
  # machine whose cores are all busy; like the one above they guard against TCP's own timeouts, and
  # the order of the events (stop lines, exit 76, relaunch) is what shows the path taken.
  awk -v s="$end_s" -v t="$((timeout_s + grace_s + 90))" 'BEGIN {exit !(s <= t)}' ||
    fail "$case: the first job ended $end_s s after the node went, more than dist.timeout_s + grace + 90 s"
  [[ -n "$t_relaunch" ]] || fail "$case: no relaunch (exit $status): $(tail -n 8 "$work/$run.log")"
  awk -v s="$relaunch_s" -v t="$((timeout_s + grace_s + 120))" 'BEGIN {exit !(s <= t)}' ||
    fail "$case: the job ended $relaunch_s s after the node went, more than dist.timeout_s + grace + 120 s"
  ((status == 0)) || fail "$case: the relaunched job ended with exit $status: $(tail -n 8 "$work/$run.log")"
  grep -q "resuming from" "$vol/$run/logs/rank-00000.log" || fail "$case: the relaunch did not resume from a checkpoint"
  grep -q "relaunch 1 of 1 on 1 host(s) (node1): 2 ranks" "$work/$run.log" || fail "$case: relaunch not on node1 with 2 ranks: $(grep relaunch "$work/$run.log")"
  every_step_once "$run" "$max" || fail "$case: metrics.jsonl does not hold steps 1-$max once each"
  local dir
  for dir in "$vol/$run/checkpoints"/step_*; do
    run_in "$image" inspect --checkpoint "/work/$run/checkpoints/${dir##*/}" >"$work/$run.inspect" 2>&1 ||
      fail "$case: checkpoint ${dir##*/} does not verify: $(tail -n 3 "$work/$run.inspect")"
  done
  pass "$case: $how_stopped; the job ended with 76 after $end_s s and was relaunched on node1 with 2 ranks after $relaunch_s s; resumed from $(grep -o 'resuming from [^ ]*' "$vol/$run/logs/rank-00000.log" | tail -n 1 | sed 's|.*/||'), $max steps logged once, every checkpoint verifies"
}
wants lost && lose_node "a node lost" kill
wants cut && lose_node "a network cut" disconnect

echo "$passed passed in $SECONDS s"
