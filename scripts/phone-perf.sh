#!/usr/bin/env bash
# Where the engine's CPU goes on the phone path: the router topology of the
# phone profiles (an app namespace routed through the engine's namespace
# into its TUN, kerntun_testkit::router), MTU 1500, the per-packet driver
# (a TUN without offload, as Android's), system stack, direct outbound,
# iperf3 through it while `perf record -g` samples the engine. Prints the
# throughput, the engine's CPU per GB and the share of its samples in each
# kind of work (TUN write, TUN read, splice, epoll, scheduling, its own
# code). As root, after `cargo build --release -p kerntun-cli`:
#
#     bash scripts/phone-perf.sh [upload|download] [STREAMS] [SECONDS]
#
# Defaults: download, 16 streams, 8 seconds. Needs iproute2, iperf3 and
# perf (Debian: linux-perf). Namespaces, processes and files it made are
# removed on every exit.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=${1:-download}
streams=${2:-16}
secs=${3:-8}
engine=${KERNTUN:-${CARGO_TARGET_DIR:-target}/release/kerntun}
case $dir in
upload) rev="" ;;
download) rev="-R" ;;
*)
    echo "phone-perf.sh: upload or download, not $dir" >&2
    exit 2
    ;;
esac
source scripts/router-topology.sh
router_requires phone-perf.sh "$engine" iperf3 perf python3

router_begin p 7

router_engine_config ktpt >"$work/engine.toml"
ip netns exec "$srv" iperf3 -s -B 198.19.7.2 >/dev/null 2>&1 &
spid=$!
ip netns exec "$eng" "$engine" run --config "$work/engine.toml" >/dev/null 2>"$work/engine.log" &
epid=$!
router_engine_started "$eng" "$work/engine.log" 100 198.19.7.2 ktpt
sleep 0.5

ticks() { awk '{print $14 + $15}' "/proc/$epid/stat"; }
t0=$(ticks)
# Sample the middle of the run (not its start and end).
(sleep 1 && perf record -F 999 -g -p "$epid" -o "$work/perf.data" -- sleep $((secs - 2)) >/dev/null 2>&1) &
perf_pid=$!
ip netns exec "$app" iperf3 -c 198.19.7.2 $rev -P "$streams" -t "$secs" -J >"$work/iperf.json"
t1=$(ticks)
wait "$perf_pid"
perf report -i "$work/perf.data" --children --sort symbol --stdio -g none 2>/dev/null >"$work/report.txt"
perf report -i "$work/perf.data" --no-children --sort dso --stdio -g none 2>/dev/null >"$work/dso.txt"

python3 - "$work" "$t0" "$t1" "$(getconf CLK_TCK)" "$dir" "$streams" <<'EOF'
import json, re, sys
work, t0, t1, hz, direction, streams = sys.argv[1:]
j = json.load(open(f"{work}/iperf.json"))
moved = j["end"]["sum_received"]["bytes"]
secs = j["end"]["sum_received"]["seconds"]
cpu = (int(t1) - int(t0)) / int(hz)
children = {}
for line in open(f"{work}/report.txt"):
    m = re.match(r"\s*([\d.]+)%\s+([\d.]+)%\s+\[[.k]\]\s+(\S+)", line)
    if m:
        children.setdefault(m.group(3), float(m.group(1)))
own = 0.0
for line in open(f"{work}/dso.txt"):
    m = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
    if m and m.group(2) == "kerntun":
        own = float(m.group(1))
def share(*names):
    return max((children.get(n, 0.0) for n in names), default=0.0)
rows = [
    ("TUN write (tun_chr_write_iter: the kernel's receive of each packet, forwarding or TCP, in the engine's call)", share("tun_chr_write_iter")),
    ("TUN read (tun_chr_read_iter)", share("tun_chr_read_iter")),
    ("splice relay (do_splice)", share("do_splice")),
    ("epoll_wait (do_epoll_wait)", share("do_epoll_wait")),
    ("outbound socket send/recv (__sys_sendto, __sys_recvfrom)", share("__sys_sendto") + share("__sys_recvfrom")),
    ("the engine's own code (samples in the kerntun binary itself)", own),
]
print(f"{direction}, {streams} streams, {secs:.1f} s: {moved * 8 / secs / 1e9:.2f} Gbit/s, "
      f"engine CPU {cpu:.2f} s, {cpu / (moved / 1e9):.2f} CPU s/GB")
print("share of the engine's samples (inclusive; the kinds overlap only where one calls another):")
for what, pct in rows:
    print(f"  {pct:5.1f} %  {what}")
EOF
