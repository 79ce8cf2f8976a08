#!/usr/bin/env bash
# The benchmark page in one command, as root, from anywhere in the repository:
#
#     bash scripts/bench.sh [harness options]
#
# Installs what is missing (Debian: iperf3, python3-matplotlib, iproute2,
# linux-perf), builds the release engine and the harness, runs the criterion
# benches and the netns harness (with perf-sampled splice/copy runs), and
# writes docs/benchmarks.md, docs/benchmarks/results.jsonl and
# docs/benchmarks/chart.png. About 21 minutes on a 2-core machine once built,
# 9 of them the phone profiles before the phone's own TUN joined them
# (`--phone` runs the phone profiles alone).
#
# Harness options (all optional; `scripts/bench.sh --help` lists them):
#   --duration 5            seconds per iperf3 run
#   --streams 1,16,64       iperf3 parallel streams
#   --connections 1000,4000,10000   idle connections held through the engine
#   --only system-batch     only these engine scenarios (the baseline always runs)
#   --skip-criterion --skip-scale --skip-profile --skip-phone   leave those parts out
#   --profile-streams 1,16  streams of the perf-sampled splice/copy runs
#   --phone                 only the phone profiles (android/router/local topology,
#                           per-packet/batch driver, baselines, and the UDP part);
#                           replaces the records of what it measured, keeps the rest
#   --phone-tun-only        only the phone's own TUN: the android topology (the
#                           client as an app's uid routed into the TUN by a uid
#                           rule, TUN txqueuelen 500, one engine runtime thread), MTU 1500/4064/9000,
#                           per-packet driver, batch driver as the reference, and
#                           the baseline; the same as `--phone --phone-topologies
#                           android --skip-phone-udp`
#   --phone-topologies android,router,local --phone-mtus 1500,9000 (router, local)
#   --phone-android-mtus 1500,4064,9000
#   --phone-syscall-streams 16   streams of the perf-stat-counted phone runs (0: none)
#   --phone-udp-only        only the phone profiles' UDP part (QUIC-shaped: 1200-byte
#                           datagrams at full rate, router topology, MTU 1500,
#                           per-packet/batch driver, baseline); keeps every other record
#   --skip-phone-udp --phone-udp-mtus 1500 --phone-udp-drivers per-packet,batch
#   --phone-udp-streams 1
#   --render-only           re-render the page and chart from results.jsonl
#   --phone-before-rev REV  also run the engine built at git revision REV in the
#                           per-packet phone profiles (every topology, TCP and UDP):
#                           the page's "Before and after"; with --phone-tun-only,
#                           the phone's own TUN before and after
set -euo pipefail
cd "$(dirname "$0")/.."

target=${CARGO_TARGET_DIR:-target}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,42p' "$0" | sed 's/^# \{0,1\}//'
    if [[ -x $target/release/kerntun-netbench ]]; then
        "$target/release/kerntun-netbench" --help
    fi
    exit 0
fi

if [[ $EUID -ne 0 ]]; then
    echo "bench.sh: needs root (network namespaces, veth, a TUN device): run it in a root shell, or with sudo (sudo env PATH=\"\$PATH\" bash $0 $*)" >&2
    exit 2
fi
if ! command -v cargo >/dev/null; then
    echo "bench.sh: cargo not on PATH (when started through sudo: sudo env PATH=\"\$PATH\" bash $0 $*)" >&2
    exit 2
fi

# Debian packages. The chart needs matplotlib for some python3: the first
# python3 on PATH if it has it, else Debian's /usr/bin/python3 with
# python3-matplotlib.
need=()
command -v ip >/dev/null || need+=(iproute2)
command -v iperf3 >/dev/null || need+=(iperf3)
# perf samples the engine for the splice section's CPU breakdown and counts
# the phone profiles' system calls.
command -v perf >/dev/null || need+=(linux-perf)
python=""
for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import matplotlib' 2>/dev/null; then
        python=$p
        break
    fi
done
if [[ -z $python ]]; then
    need+=(python3-matplotlib)
    python=/usr/bin/python3
fi
if ((${#need[@]})); then
    if ! command -v apt-get >/dev/null; then
        echo "bench.sh: missing ${need[*]} and no apt-get to install them" >&2
        exit 2
    fi
    echo "bench.sh: apt-get install ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [[ ! -c /dev/net/tun ]]; then
    modprobe tun 2>/dev/null || true
    if [[ ! -c /dev/net/tun ]]; then
        mkdir -p /dev/net && mknod /dev/net/tun c 10 200 && chmod 0666 /dev/net/tun
    fi
fi

if [[ ${1:-} != --render-only ]]; then
    echo "bench.sh: cargo build --release -p kerntun-cli -p kerntun-benches --bins" >&2
    cargo build --release -p kerntun-cli -p kerntun-benches --bins
fi

# --phone-before-rev REV: build the engine of an earlier revision (in a
# temporary worktree, its own target directory) and run it beside the
# current one in the per-packet phone profiles (`--phone-before`).
command=("$@")
args=()
while (($#)); do
    if [[ $1 == --phone-before-rev ]]; then
        rev=${2:?--phone-before-rev needs a git revision}
        shift 2
        short=$(git rev-parse --short "$rev")
        tree=$(mktemp -d)
        git worktree add --detach "$tree" "$rev" >/dev/null
        echo "bench.sh: building the engine at $short (before)" >&2
        # Start from this tree's release dependencies: only the workspace
        # crates are built again.
        if [[ ! -d $target/before/release ]]; then
            mkdir -p "$target/before/release"
            cp -a "$target/release/deps" "$target/release/build" "$target/release/.fingerprint" "$target/before/release/"
        fi
        CARGO_TARGET_DIR="$target/before" cargo build --release --manifest-path "$tree/Cargo.toml" -p kerntun-cli
        git worktree remove --force "$tree"
        args+=(--phone-before "$(realpath "$target")/before/release/kerntun" --phone-before-label "$short")
    else
        args+=("$1")
        shift
    fi
done

# exec: Ctrl-C reaches the harness directly, which stops what it started and
# removes its namespaces.
exec "$target/release/kerntun-netbench" \
    --engine "$target/release/kerntun" \
    --python "$python" \
    --command "bash scripts/bench.sh${command[*]:+ ${command[*]}}" \
    "${args[@]}"
