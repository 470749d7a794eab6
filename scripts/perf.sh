#!/usr/bin/env bash
# The request-cost measurement of README "Performance": memproxy beside nginx, in one run.
#
# nginx (Debian's `nginx`, run as this user's own processes on 127.0.0.1, configs written into
# a temporary directory) serves one constant chat completion as the upstream. Then, round after
# round, wrk (Debian's `wrk`, POST bodies from a Lua script) measures each row for DURATION
# seconds at CONNECTIONS connections:
#
#   direct          wrk → upstream
#   nginx           wrk → nginx as a reverse proxy (keep-alive to the upstream) → upstream
#   pass            wrk → memproxy, a POST /v1/chat/completions without a conversation id
#                   (passed through untouched) → upstream
#   mem-ro          wrk → memproxy, memory on: 64 conversations of 200 stored messages, each
#                   request a new user message with X-Memory-Persist: false
#   mem-store       the same, each exchange stored (64 new conversations of 200 messages each
#                   round, so every round starts from the same history)
#
# The memproxy rows are measured for the binary built from this tree and, with --baseline, for
# a second binary (an earlier commit's) beside it: each its own process and data directory,
# both rows in every round. The rows alternate (each round runs them in the reverse order of the
# round before) and the report gives each ratio pair by pair within a round: median and range
# over the rounds, since a shared machine drifts.
#
# Usage: scripts/perf.sh [--rounds N] [--duration S] [--connections C] [--baseline BINARY]
#                        [--binary BINARY] [--log LEVEL] [--budget SIZE] [--keep] [--record DIR]
#                        [--extra FILE] [--baseline-extra FILE] [--floor BINARY]
#                        [--storage FILE] [--baseline-storage FILE]
#                        [--runtime SHAPE] [--baseline-runtime SHAPE]
# --budget SIZE: memproxy's server.memory_budget (default: its default, 192MiB).
# --extra FILE: TOML added to each memproxy's config (any section but [server], [upstream] and
# [storage], which the script writes), e.g. `[embedding]\nembedder = "off"`;
# --baseline-extra FILE: the same for the baseline binary only (default: --extra's), so two
# settings of one binary can be compared in one run (--baseline the same binary).
# --storage FILE: lines added to the [storage] section the script writes for memproxy, e.g.
# `backend = "fjall"` or `durability = "interval"`; --baseline-storage FILE: the same for the
# baseline binary only (default: --storage's), so two engines or durabilities of one binary
# can be compared in one run.
# --runtime SHAPE: memproxy's server.runtime ("per-thread", the default on Linux, or "shared");
# --baseline-runtime SHAPE: the same for the baseline (default: --runtime's), so the two shapes
# of one binary can be compared in one run (--baseline the same binary).
# --floor BINARY: also measure the floor under the pass-through row, the bare hyper proxy of
# `examples/hyper_floor.rs` (`cargo build --release --example hyper_floor`), as two rows:
# `floor` (one multi-thread runtime of 2 workers, as memproxy) and `floorpt` (2 single-thread
# runtimes, a listener each on one port, nothing crossing threads).
# --record DIR: each memproxy row of the first round is also sampled with `perf record -g`
# (Debian's linux-perf) into DIR/ROW.data, for `perf report -i DIR/ROW.data`; set
# PERF_CALL_GRAPH="--call-graph dwarf,8192" for stacks through code without frame pointers
# (build with CARGO_PROFILE_RELEASE_STRIP=none, in a target dir of its own, to see names).
# Needs: nginx, wrk, curl, python3 (apt-get install nginx wrk curl python3); a release build
# (`cargo build --release`); the embedding model where memproxy looks for it
# (`scripts/fetch-model.sh`, then `memproxy model distill`), else the memory rows recall by
# words alone and the script warns. Every address is on 127.0.0.1; every load loop ends after
# DURATION. Run as root, the measured processes get `nice -n -15` (elsewhere they run at the
# usual priority).
set -euo pipefail

rounds=5
duration=8
connections=64
threads=2
binary=target/release/memproxy
baseline=""
log_level=warn
keep=false
record=""
budget=""
extra=""
baseline_extra=""
storage=""
baseline_storage=""
floor=""
runtime=""
baseline_runtime=""
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --duration) duration=$2; shift 2 ;;
        --connections) connections=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --binary) binary=$2; shift 2 ;;
        --baseline) baseline=$2; shift 2 ;;
        --log) log_level=$2; shift 2 ;;
        --keep) keep=true; shift ;;
        --record) record=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --extra) extra=$2; shift 2 ;;
        --baseline-extra) baseline_extra=$2; shift 2 ;;
        --storage) storage=$2; shift 2 ;;
        --baseline-storage) baseline_storage=$2; shift 2 ;;
        --floor) floor=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --baseline-runtime) baseline_runtime=$2; shift 2 ;;
        -h|--help) sed -n '2,54p' "$0"; exit 0 ;;
        *) echo "perf.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
for tool in nginx wrk curl python3; do
    command -v "$tool" >/dev/null || { echo "perf.sh: $tool is missing (apt-get install $tool)" >&2; exit 2; }
done
[ -x "$binary" ] || { echo "perf.sh: no binary at $binary (cargo build --release)" >&2; exit 2; }
[ -z "$baseline" ] || [ -x "$baseline" ] || { echo "perf.sh: no baseline binary at $baseline" >&2; exit 2; }
[ -z "$floor" ] || [ -x "$floor" ] || { echo "perf.sh: no floor binary at $floor (cargo build --release --example hyper_floor)" >&2; exit 2; }
conversations=64
messages=200

nice_cmd=()
[ "$(id -u)" = 0 ] && nice_cmd=(nice -n -15)

dir=$(mktemp -d /tmp/memproxy-perf.XXXXXX)
chmod 755 "$dir" # nginx's workers run as another user
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for conf in "$dir"/nginx-*.conf; do
        [ -f "$conf" ] && nginx -c "$conf" -p "$dir" -s stop 2>/dev/null || true
    done
    wait 2>/dev/null || true
    if [ "$keep" = true ]; then echo "kept $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
upstream_port=$(free_port)
proxy_port=$(free_port)

# The constant answer: a whole chat completion, as a provider sends it.
answer='{"id":"chatcmpl-perf","object":"chat.completion","created":1700000000,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"This is the constant answer of the measurement upstream: the garden plan stays as agreed and the budget is unchanged."},"finish_reason":"stop"}],"usage":{"prompt_tokens":24,"completion_tokens":22,"total_tokens":46}}'

write_nginx() { # name workers body
    cat >"$dir/nginx-$1.conf" <<EOF
daemon on;
pid $dir/nginx-$1.pid;
worker_processes $2;
error_log $dir/nginx-$1.error.log warn;
events { worker_connections 4096; }
http {
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 120s;
    client_body_temp_path $dir/nginx-$1-body;
    proxy_temp_path $dir/nginx-$1-proxy;
    fastcgi_temp_path $dir/nginx-$1-fastcgi;
    uwsgi_temp_path $dir/nginx-$1-uwsgi;
    scgi_temp_path $dir/nginx-$1-scgi;
$3
}
EOF
}
write_nginx upstream 1 "    server {
        listen 127.0.0.1:$upstream_port;
        default_type application/json;
        location / { return 200 '$answer'; }
    }"
nginx_port=$(free_port)
write_nginx proxy auto "    upstream memproxy_perf_upstream {
        server 127.0.0.1:$upstream_port;
        keepalive 128;
        keepalive_requests 1000000;
    }
    server {
        listen 127.0.0.1:$nginx_port;
        location / {
            proxy_pass http://memproxy_perf_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
        }
    }"
for name in upstream proxy; do
    "${nice_cmd[@]}" nginx -c "$dir/nginx-$name.conf" -p "$dir" -e "$dir/nginx-$name.error.log"
done

# memproxy: one process per binary, each with its own data directory, started anew at each
# round (so every round starts from the same caches and resident memory).
declare -A port_of pid_of binary_of extra_of storage_of runtime_of
budget_line=""
[ -z "$budget" ] || budget_line="memory_budget = \"$budget\""
start_memproxy() { # name
    local port=${port_of[$1]}
    mkdir -p "$dir/$1"
    cat >"$dir/$1/memproxy.toml" <<EOF
[server]
listen = "127.0.0.1:$port"
shutdown_grace = "PT5S"
$budget_line
${runtime_of[$1]:+runtime = \"${runtime_of[$1]}\"}

[upstream]
base_url = "http://127.0.0.1:$upstream_port/v1"
connect_timeout = "PT2S"

[upstream.anthropic]
base_url = "http://127.0.0.1:$upstream_port"

[storage]
data_dir = "$dir/$1/data"
$(if [ -n "${storage_of[$1]}" ]; then cat "${storage_of[$1]}"; fi)
EOF
    if [ -n "${extra_of[$1]}" ]; then
        cat "${extra_of[$1]}" >>"$dir/$1/memproxy.toml"
    fi
    RUST_LOG=$log_level "${nice_cmd[@]}" "${binary_of[$1]}" --config "$dir/$1/memproxy.toml" \
        serve >>"$dir/$1/log" 2>&1 &
    pid_of[$1]=$!
    pids+=($!)
    for _ in $(seq 100); do
        if ready=$(curl -fs "http://127.0.0.1:$port/readyz" 2>/dev/null); then
            # A binary that found no model recalls by words alone: the memory rows would not
            # measure the default (a fresh checkout needs scripts/fetch-model.sh and
            # `memproxy model distill`).
            case "$ready" in
                *'"embedder_reason"'*)
                    echo "perf.sh: warning: memproxy $1 recalls by words alone: $ready" >&2 ;;
            esac
            return 0
        fi
        sleep 0.1
    done
    echo "perf.sh: memproxy $1 did not start:" >&2; cat "$dir/$1/log" >&2; exit 1
}
stop_memproxy() { # name
    kill "${pid_of[$1]}" 2>/dev/null || true
    while kill -0 "${pid_of[$1]}" 2>/dev/null; do sleep 0.1; done
}
binaries=(new)
port_of[new]=$proxy_port
binary_of[new]=$binary
extra_of[new]=$extra
storage_of[new]=$storage
runtime_of[new]=$runtime
if [ -n "$baseline" ]; then
    binaries+=(base)
    port_of[base]=$(free_port)
    binary_of[base]=$baseline
    extra_of[base]=${baseline_extra:-$extra}
    storage_of[base]=${baseline_storage:-$storage}
    runtime_of[base]=${baseline_runtime:-$runtime}
fi
for name in "${binaries[@]}"; do start_memproxy "$name"; done
floors=()
if [ -n "$floor" ]; then
    for kind in floor floorpt; do
        port_of[$kind]=$(free_port)
        floor_runtime=multi
        [ "$kind" = floorpt ] && floor_runtime=per-thread
        "${nice_cmd[@]}" "$floor" --listen "127.0.0.1:${port_of[$kind]}" \
            --upstream "127.0.0.1:$upstream_port" --runtime "$floor_runtime" --threads 2 \
            >"$dir/$kind.log" 2>&1 &
        pid_of[$kind]=$!
        pids+=($!)
        floors+=("$kind")
    done
    for kind in "${floors[@]}"; do
        for _ in $(seq 50); do
            curl -s -o /dev/null "http://127.0.0.1:${port_of[$kind]}/" && break
            sleep 0.1
        done
    done
fi

# The pre-filled conversations: 199 alternating messages (the reply makes 200), words drawn
# with a fixed seed from loadbench's word list, different in each conversation
# (`scripts/perf_seeds.py`, which `scripts/instructions.py` fills its conversations with too).
python3 "$(dirname "$0")/perf_seeds.py" "$dir" "$conversations" "$messages"
seed() { # binary-name prefix [expected status] [body]: one request per conversation
    local port=${port_of[$1]} expect=${3:-stored} body=${4:-}
    [ -n "$body" ] || body="@$dir/seed-{}.json"
    local persist=""
    [ "$expect" = stored ] || persist="-H 'x-memory-persist: false'"
    seq 0 $((conversations - 1)) | xargs -P 4 -I{} sh -c "
        status=\$(curl -s -o /dev/null -D - --max-time 60 -H 'content-type: application/json' \
            -H 'authorization: Bearer sk-perf' -H 'x-memory-conversation-id: $2{}' $persist \
            --data-binary $body http://127.0.0.1:$port/v1/chat/completions \
            | tr -d '\r' | sed -n 's/^x-memory-status: //Ip')
        [ \"\$status\" = $expect ] || echo \"perf.sh: WARNING $2{} on $1: x-memory-status '\$status'\" >&2"
}
for name in "${binaries[@]}"; do seed "$name" ro-; done

# The requests: one new user message each, unique by thread and count; the conversation (in
# the memory rows) taken in turn from the thread's share of the 64.
cat >"$dir/requests.lua" <<'EOF'
local threads = 0
function setup(thread)
    thread:set("tid", threads)
    threads = threads + 1
end
local counter = 0
function init(args)
    conversations = tonumber(args[1])
    prefix = args[2]
    persist = args[3]
    share = math.max(1, math.floor(conversations / tonumber(args[4])))
end
function request()
    counter = counter + 1
    local body = '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Question '
        .. counter .. ' of thread ' .. tid
        .. ': what did we decide about the garden plan, the budget and the tickets?"}]}'
    local headers = { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer sk-perf" }
    if conversations > 0 then
        headers["X-Memory-Conversation-Id"] = prefix .. (tid * share + counter % share)
        if persist == "false" then headers["X-Memory-Persist"] = "false" end
    end
    return wrk.format("POST", "/v1/chat/completions", headers, body)
end
EOF

measure() { # port conversations prefix persist [binary] [record] → req/s and CPU µs/request
    local out pid="" cpu_before=0 cpu_after
    if [ -n "${5:-}" ]; then
        pid=${pid_of[$5]}
        cpu_before=$(cpu_ticks "$pid")
    fi
    if [ -n "${6:-}" ]; then
        mkdir -p "$record"
        perf record -e cpu-clock ${PERF_CALL_GRAPH:--g} -p "$pid" -o "$record/$6.data" -- sleep $((duration - 1)) \
            >/dev/null 2>&1 &
    fi
    out=$("${nice_cmd[@]}" wrk -t"$threads" -c"$connections" -d"${duration}s" --timeout 10s \
        -s "$dir/requests.lua" "http://127.0.0.1:$1" -- "$2" "$3" "$4" "$threads" 2>&1)
    echo "$out" >>"$dir/wrk.log"
    if echo "$out" | grep -q "Non-2xx"; then
        echo "perf.sh: non-2xx answers on port $1: $(echo "$out" | grep Non-2xx)" >&2
    fi
    wait_recording
    local rps requests cpu="-"
    rps=$(echo "$out" | awk '/^Requests\/sec:/ {print $2}')
    requests=$(echo "$out" | awk '/requests in/ {print $1}')
    if [ -n "$pid" ] && [ "${requests:-0}" -gt 0 ]; then
        cpu_after=$(cpu_ticks "$pid")
        cpu=$(( (cpu_after - cpu_before) * 1000000 / $(getconf CLK_TCK) / requests ))
    fi
    printf '%s\t%s' "$rps" "$cpu"
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
wait_recording() { for job in $(jobs -p); do wait "$job" 2>/dev/null || true; done; }

rows=(direct nginx "${floors[@]}")
for name in "${binaries[@]}"; do rows+=("pass-$name" "mem-ro-$name" "mem-store-$name"); done
results="$dir/results.tsv"
: >"$results"
echo "rows: ${rows[*]}; $rounds rounds of ${duration} s each, $connections connections, wrk -t$threads"
warm_body='{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Where were we?"}]}'
for round in $(seq "$rounds"); do
    for name in "${binaries[@]}"; do
        if [ "$round" -gt 1 ]; then stop_memproxy "$name"; start_memproxy "$name"; fi
        # A new set of stored conversations for the stored row of this round, and the
        # read-only conversations read once (loaded into the caches, as in steady use).
        seed "$name" "st$round-"
        seed "$name" ro- not-stored "'$warm_body'"
        if [ "$round" = 1 ]; then
            curl -s "http://127.0.0.1:${port_of[$name]}/metrics" | awk -v who="$name" \
                '/^memproxy_cache_bytes\{cache="recall"\}/ { printf "[%s] recall indexes of the 64 read-only conversations (200 messages): %.1f MiB\n", who, $NF / 1048576 }'
        fi
    done
    order=("${rows[@]}")
    if [ $((round % 2)) = 0 ]; then
        order=(); for ((i = ${#rows[@]} - 1; i >= 0; i--)); do order+=("${rows[$i]}"); done
    fi
    line="round $round:"
    for row in "${order[@]}"; do
        rec=""
        [ -n "$record" ] && [ "$round" = 1 ] && rec=$row
        who=${row##*-}
        case "$row" in
            direct) got=$(measure "$upstream_port" 0 - -) ;;
            nginx) got=$(measure "$nginx_port" 0 - -) ;;
            floor|floorpt) got=$(measure "${port_of[$row]}" 0 - - "$row" "$rec") ;;
            pass-*) got=$(measure "${port_of[$who]}" 0 - - "$who" "$rec") ;;
            mem-ro-*) got=$(measure "${port_of[$who]}" "$conversations" ro- false "$who" "$rec") ;;
            mem-store-*) got=$(measure "${port_of[$who]}" "$conversations" "st$round-" true "$who" "$rec") ;;
        esac
        printf '%s\t%s\t%s\n' "$round" "$row" "$got" >>"$results"
        line+=" $row=${got%%$'\t'*}"
    done
    echo "$line"
    # A memory row is only a memory row if memory ran: requests the memory guard served with
    # memory off (as pass-through) would flatter it.
    for name in "${binaries[@]}"; do
        curl -s "http://127.0.0.1:${port_of[$name]}/metrics" \
            | awk -v who="$name" -v round="$round" '/^memproxy_admission_refused[a-z_]*\{/ && $NF > 0 {
                print "perf.sh: WARNING round " round " [" who "] " $0 > "/dev/stderr" }'
    done
done
# Where a memory request's time goes (the last round's mem-ro and mem-store rows together):
# each stage's mean, from memproxy's own histograms.
for name in "${binaries[@]}"; do
    curl -s "http://127.0.0.1:${port_of[$name]}/metrics" | tee "$dir/$name/metrics-last" | awk -v who="$name" '
        /^memproxy_stage_duration_seconds_(sum|count)\{/ {
            match($0, /stage="[a-z_]*"/); stage = substr($0, RSTART + 7, RLENGTH - 8)
            if ($0 ~ /_sum\{/) sum[stage] = $NF; else count[stage] = $NF }
        END { line = "[" who "] mean µs per stage, last round:"
              for (s in count) if (count[s] > 0) line = line sprintf(" %s %.0f (%d)", s, sum[s] / count[s] * 1e6, count[s])
              print line }'
done

python3 - "$results" "${#floors[@]}" "${binaries[@]}" <<'EOF'
import statistics, sys
from collections import defaultdict
path, floors, binaries = sys.argv[1], ["floor", "floorpt"][: int(sys.argv[2])], sys.argv[3:]
by_round = defaultdict(dict)
cpu = defaultdict(dict)
for line in open(path):
    r, row, rps, us = line.rstrip("\n").split("\t")
    by_round[r][row] = float(rps)
    if us != "-":
        cpu[r][row] = float(us)
def spread(values):
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"
def ratio(a, b):
    return [x[a] / x[b] for x in by_round.values() if x.get(b)]
print("\nreq/s, median (min–max) over the rounds:")
for row in ["direct", "nginx"] + floors + [r for b in binaries for r in (f"pass-{b}", f"mem-ro-{b}", f"mem-store-{b}")]:
    values = [x[row] for x in by_round.values()]
    us = [x[row] for x in cpu.values() if row in x]
    used = f"   {'floor' if row in floors else 'memproxy'} CPU µs/request {statistics.median(us):6.0f} ({min(us):.0f}–{max(us):.0f})" if us else ""
    print(f"  {row:16} {statistics.median(values):9.0f} ({min(values):.0f}–{max(values):.0f}){used}")
print("\nratios, pair by pair within a round: median (min–max)")
print(f"  nginx / direct               {spread(ratio('nginx', 'direct'))}")
for f in floors:
    print(f"  {f} / nginx{' ' * (19 - len(f))}{spread(ratio(f, 'nginx'))}")
for b in binaries:
    print(f"  [{b}] pass / nginx          {spread(ratio(f'pass-{b}', 'nginx'))}")
    if floors:
        print(f"  [{b}] pass / floor          {spread(ratio(f'pass-{b}', 'floor'))}")
    print(f"  [{b}] mem-ro / pass         {spread(ratio(f'mem-ro-{b}', f'pass-{b}'))}")
    print(f"  [{b}] mem-store / pass      {spread(ratio(f'mem-store-{b}', f'pass-{b}'))}")
if "base" in binaries:
    for row in ("pass", "mem-ro", "mem-store"):
        print(f"  new / base, {row:10}       {spread(ratio(f'{row}-new', f'{row}-base'))}")
    print("CPU µs/request, new / base, pair by pair:")
    for row in ("pass", "mem-ro", "mem-store"):
        pairs = [x[f"{row}-new"] / x[f"{row}-base"] for x in cpu.values() if x.get(f"{row}-base")]
        print(f"  {row:10} {spread(pairs)}")
    # How far apart the rounds were: a step smaller than this is not told from the noise here.
    widths = []
    for row in ("pass", "mem-ro", "mem-store"):
        pairs = ratio(f"{row}-new", f"{row}-base")
        if len(pairs) > 1:
            widths.append((max(pairs) - min(pairs)) / statistics.median(pairs))
    if widths and max(widths) > 0.05:
        print(f"note: the new / base ratios ranged over up to {100 * max(widths):.0f}% of their "
              "median across rounds; a smaller step is better counted with "
              "scripts/instructions.py (instructions, repeatable within about 0.3%)")
EOF
