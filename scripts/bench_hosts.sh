#!/usr/bin/env bash
# Two hosts made of network namespaces (as tests/src/hosts.rs makes them: one namespace per host, veth
# pairs to a bridge in a switch namespace) and what their links cost a job:
# - accel-dist's TCP all-reduce between them, one rank per host (bench_allreduce's workers): bus
#   bandwidth per size;
# - train_gpt on 2 CPU ranks per host, one `accel launch --num_machines 2` per host: steps/s;
# each on plain links, on links limited to 1 Gbit/s (tbf), and with 5 ms of delay on top (netem) where
# the kernel has it (else that row says why not). Prints one JSON object.
#
#   cargo build --release -p accel-cli --bin accel -p accel-dist --example bench_allreduce \
#       -p accel-examples --example train_gpt
#   sudo scripts/bench_hosts.sh [STEPS]        # STEPS of train_gpt per setting (default 60)
#   LINKS="rate plain delay" ...               # the settings, in this order
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-60}
bin=${CARGO_TARGET_DIR:-target}/release
for b in "$bin/accel" "$bin/examples/bench_allreduce" "$bin/examples/train_gpt"; do
  [[ -x $b ]] || { echo "bench_hosts.sh: $b is not built (see the header)" >&2; exit 2; }
done
tag="bh$$"
subnet=$(( 100 + $$ % 100 ))
hosts=("${tag}h0" "${tag}h1")
sw="${tag}sw"
out=$(mktemp -d)
cleanup() {
  for ns in "${hosts[@]}" "$sw"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$out"
}
trap cleanup EXIT
for ns in "${hosts[@]}" "$sw"; do
  ip netns add "$ns"
  ip -n "$ns" link set lo up
done
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
for i in 0 1; do
  ip -n "${hosts[$i]}" link add "v$i" type veth peer name "s$i" netns "$sw"
  ip -n "$sw" link set "s$i" master br0
  ip -n "$sw" link set "s$i" up
  ip -n "${hosts[$i]}" addr add "10.232.$subnet.$((i + 1))/24" dev "v$i"
  ip -n "${hosts[$i]}" link set "v$i" up
done
addr0="10.232.$subnet.1"

# Sets the links' queueing discipline: plain, rate, or delay (rate and 5 ms); says why not when refused.
links() {
  for i in 0 1; do
    local ns=${hosts[$i]}
    ip netns exec "$ns" tc qdisc del dev "v$i" root 2>/dev/null || true
    case $1 in
      plain) ;;
      rate) ip netns exec "$ns" tc qdisc replace dev "v$i" root tbf rate 1gbit burst 256kb latency 50ms ;;
      delay) ip netns exec "$ns" tc qdisc replace dev "v$i" root netem delay 5ms rate 1gbit 2>&1 || return 1 ;;
    esac
  done
}

allreduce() {
  local port=$((29700 + RANDOM % 200)) pids=()
  for r in 0 1; do
    ip netns exec "${hosts[$r]}" env RANK=$r WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
      MASTER_ADDR="$addr0" MASTER_PORT=$port ACCEL_JOB_TOKEN=bench-hosts ACCEL_DIST_TIMEOUT=120 \
      "$bin/examples/bench_allreduce" --worker --json --no-gloo --transport socket --tcp-only \
      --ops all_reduce --sizes 1048576,16777216,67108864 > "$out/allreduce$r" &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$out/allreduce0"
}

train() {
  local port=$((29900 + RANDOM % 90)) pids=()
  for m in 0 1; do
    ip netns exec "${hosts[$m]}" env ACCEL_JOB_TOKEN=bench-hosts "$bin/accel" launch --cpu \
      --num_machines 2 --machine_rank $m --num_processes 4 --num_cpu_threads_per_process 1 \
      --main_process_ip "$addr0" --main_process_port $port \
      "$bin/examples/train_gpt" --steps "$steps" --out "$out/run$m" > "$out/train$m" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  # "[rank0]: 3.2 steps/s; checkpoint ...": the main process's figure for the whole run.
  grep -o '[0-9.]* steps/s' "$out/train0" | tail -n 1 | cut -d' ' -f1
}

rows=()
for setting in ${LINKS:-plain rate delay}; do
  if ! why=$(links "$setting"); then
    rows+=("{\"links\":\"$setting\",\"measured\":false,\"why\":$(python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$why")}")
    continue
  fi
  ar=$(allreduce)
  sps=$(train)
  rows+=("{\"links\":\"$setting\",\"measured\":true,\"allreduce\":$ar,\"train_gpt_steps_per_s\":$sps}")
done
links plain
python3 - "$steps" "$(lscpu | sed -n 's/^Model name: *//p' | head -n 1)" "$(uname -r)" "${rows[@]}" <<'EOF'
import json, sys
steps, cpu, kernel, *rows = sys.argv[1:]
rows = [json.loads(r) for r in rows]
plain = next(r for r in rows if r["links"] == "plain")
for r in rows:
    if r.get("measured"):
        r["step_time_vs_plain"] = round(plain["train_gpt_steps_per_s"] / r["train_gpt_steps_per_s"], 3)
        r["allreduce_busbw_gbps"] = {
            str(x["bytes"]): x.get("busbw_gbps", x.get("bus_gbps")) for x in r["allreduce"]["results"]
        }
print(json.dumps({
    "bench": "bench_hosts", "cpu": cpu, "kernel": kernel,
    "hosts": 2, "ranks_per_host": 2, "train_gpt_steps": int(steps),
    "links": "veth pairs to a bridge in a switch namespace; rate: tbf 1gbit; delay: netem 5ms + 1gbit",
    "rows": rows,
}))
EOF
