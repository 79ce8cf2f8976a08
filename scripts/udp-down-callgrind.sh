#!/usr/bin/env bash
# The engine's own instructions per downloaded UDP datagram, counted by
# callgrind (load-independent, unlike CPU time on a shared machine): the
# router topology of the phone profiles (as scripts/phone-perf.sh: an app
# namespace routed through the engine's namespace into its TUN, MTU 1500,
# the per-packet driver, direct outbound with its default
# endpoint-independent mapping). The app sends one request; the server
# answers with COUNT datagrams of 1,200 bytes (QUIC-shaped, as the phone
# profiles' UDP part), BURST at a time every GAP_MS milliseconds, slow
# enough that the engine under valgrind keeps up (what overflowed its
# socket is printed: UdpRcvbufErrors). Counters are zeroed after the
# request's reply, before the app's "go", and dumped once the app has
# every datagram (or heard nothing for 3 s), so start-up is not counted;
# the total is divided by the datagrams the app got. As root, after
# `cargo build --release -p kerntun-cli`:
#
#     bash scripts/udp-down-callgrind.sh [COUNT] [BURST] [GAP_MS]
#
# Defaults: 20000 datagrams, 16 per burst, 8 ms apart. Prints the
# datagrams the app got, the engine's instructions per datagram, and
# callgrind_annotate's inclusive top functions. Needs iproute2, python3 and
# valgrind. KERNTUN=path runs another engine binary; UDP_NAT=connected
# sets `direct.udp_nat` (default: endpoint-independent); KEEP=dir keeps
# the callgrind output there.
set -euo pipefail
cd "$(dirname "$0")/.."

count=${1:-20000}
burst=${2:-16}
gap=${3:-8}
engine=${KERNTUN:-${CARGO_TARGET_DIR:-target}/release/kerntun}
source scripts/router-topology.sh
router_requires udp-down-callgrind.sh "$engine" python3 valgrind callgrind_control callgrind_annotate

# After the engine stopped (callgrind writes its last dump then).
keep() {
    if [[ -n ${KEEP:-} ]]; then
        mkdir -p "$KEEP" && cp "$work"/callgrind.out* "$KEEP"/ 2>/dev/null
    fi
}
router_begin c 8 keep

router_engine_config ktct "udp_nat = \"${UDP_NAT:-endpoint-independent}\"" >"$work/engine.toml"

# The server: a request "COUNT BURST GAP_MS" is answered with COUNT
# datagrams of 1,200 bytes to its source.
cat >"$work/server.py" <<'EOF'
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("198.19.8.2", 5300))
while True:
    req, peer = s.recvfrom(100)
    n, burst, gap = (int(x) for x in req.split())
    payload = bytes(1200)
    s.sendto(b"ready", peer)
    if s.recvfrom(100)[0] != b"go":
        continue
    t = time.monotonic()
    for i in range(n):
        s.sendto(payload, peer)
        if (i + 1) % burst == 0:
            t += gap / 1000
            d = t - time.monotonic()
            if d > 0:
                time.sleep(d)
EOF
# The app: one request, then count what comes back until 3 s of silence.
cat >"$work/client.py" <<'EOF'
import socket, subprocess, sys
n, burst, gap, zero = sys.argv[1:5]
c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
c.settimeout(60)
c.sendto(f"{n} {burst} {gap}".encode(), ("198.19.8.2", 5300))
assert c.recv(2000) == b"ready"
# The flow exists and has replied: count from here on.
subprocess.run(zero, shell=True, check=True, stdout=subprocess.DEVNULL)
c.sendto(b"go", ("198.19.8.2", 5300))
got = 0
c.settimeout(3)
try:
    while got < int(n):
        if len(c.recv(2000)) == 1200:
            got += 1
except socket.timeout:
    pass
print(got)
EOF

ip netns exec "$srv" python3 "$work/server.py" &
spid=$!
ip netns exec "$eng" valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out" \
    "$engine" run --config "$work/engine.toml" >/dev/null 2>"$work/engine.log" &
epid=$!
router_engine_started "$eng" "$work/engine.log" 600 198.19.8.2 ktct
sleep 1
# valgrind's pid is the engine's.
got=$(ip netns exec "$app" python3 "$work/client.py" "$count" "$burst" "$gap" \
    "callgrind_control --zero $epid")
callgrind_control --dump=download "$epid" >/dev/null
dump=$(ls "$work"/callgrind.out.* | head -1)
total=$(callgrind_annotate "$dump" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
echo "datagrams sent: $count ($burst every $gap ms), received by the app: $got"
echo "engine namespace, UDP receive buffer errors: $(ip netns exec "$eng" nstat -az UdpRcvbufErrors | awk '/UdpRcvbufErrors/ {print $2}')"
echo "engine instructions: $total, per datagram: $((total / (got > 0 ? got : 1)))"
callgrind_annotate --inclusive=yes "$dump" 2>/dev/null | sed -n '/^Ir/,$p' | head -45
