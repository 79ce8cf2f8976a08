# Sourced by scripts/phone-perf.sh and scripts/udp-down-callgrind.sh: what
# they need before they start, the phone profiles' router topology in
# three namespaces, the engine's configuration, start and stop there, and
# the set-up and clean-up around them.
#
#     router_requires NAME ENGINE COMMAND...
#
# exits 2 with a message naming NAME unless this is root, every COMMAND
# (and ip) is found, and ENGINE is an executable engine binary.
router_requires() {
    local name=$1 engine=$2 c
    shift 2
    if [[ $EUID -ne 0 ]]; then
        echo "$name: needs root (namespaces, a TUN device)" >&2
        exit 2
    fi
    for c in ip "$@"; do
        command -v "$c" >/dev/null || {
            echo "$name: $c not found" >&2
            exit 2
        }
    done
    [[ -x $engine ]] || {
        echo "$name: no engine at $engine (cargo build --release -p kerntun-cli)" >&2
        exit 2
    }
}

# The topology. The app namespace
# APP (10.233.N.2 on veth kta, default route via the engine) reaches the
# server namespace SRV (198.19.N.2 on kts) through the engine namespace ENG
# (kte toward the app, ktc toward the server), which forwards without
# reverse-path filtering; what arrives on kte is looked up in table 233,
# where the caller routes the server into its TUN once the engine runs.
#
#     router_topology APP ENG SRV N
#
# router_teardown APP ENG SRV removes the namespaces (errors ignored).
router_teardown() {
    local ns
    for ns in "$@"; do
        ip netns del "$ns" 2>/dev/null
    done
}

router_topology() {
    local app=$1 eng=$2 srv=$3 n=$4 ns k
    for ns in "$app" "$eng" "$srv"; do
        ip netns add "$ns"
        ip -n "$ns" link set lo up
    done
    ip -n "$eng" link add kte type veth peer name kta netns "$app"
    ip -n "$eng" link add ktc type veth peer name kts netns "$srv"
    ip -n "$app" addr add "10.233.$n.2/24" dev kta
    ip -n "$app" link set kta up mtu 1500
    ip -n "$app" route add default via "10.233.$n.1"
    ip -n "$eng" addr add "10.233.$n.1/24" dev kte
    ip -n "$eng" link set kte up mtu 1500
    ip -n "$eng" addr add "198.19.$n.1/24" dev ktc
    ip -n "$eng" link set ktc up mtu 1500
    ip -n "$srv" addr add "198.19.$n.2/24" dev kts
    ip -n "$srv" link set kts up mtu 1500
    ip -n "$srv" route add "10.233.$n.0/24" via "198.19.$n.1"
    for k in net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 \
        net.ipv4.conf.default.rp_filter=0 net.ipv4.conf.kte.rp_filter=0; do
        ip netns exec "$eng" sysctl -qw "$k"
    done
    # What the app sends arrives on kte and goes into the TUN (table 233).
    ip -n "$eng" rule add iif kte lookup 233 pref 1000
}

# router_engine_config TUN [LINE...]
#
# prints the engine's configuration for the topology: system stack, the
# per-packet driver (a TUN without offload, as Android's), a TUN named TUN
# at MTU 1500 on 198.18.0.1/16, the direct outbound out of ktc; each LINE
# is one more [direct] setting.
router_engine_config() {
    local tun=$1
    shift
    cat <<EOF
stack = "system"
driver = "per_packet"
[tun]
name = "$tun"
mtu = 1500
ipv4 = "198.18.0.1/16"
[direct]
interface = "ktc"
EOF
    (($# == 0)) || printf '%s\n' "$@"
}

# router_engine_started ENG LOG TRIES SERVER TUN
#
# waits up to TRIES tenths of a second for the engine to write "kerntun
# started on" to LOG (when it did not: prints LOG and exits 1), then routes
# SERVER (an address) into TUN in ENG's table 233.
router_engine_started() {
    local eng=$1 log=$2 tries=$3 server=$4 tun=$5
    for _ in $(seq "$tries"); do
        grep -q "kerntun started on" "$log" && break
        sleep 0.1
    done
    grep -q "kerntun started on" "$log" || {
        cat "$log" >&2
        exit 1
    }
    ip -n "$eng" route add "$server/32" dev "$tun" table 233
}

# router_begin TAG N [AFTER]
#
# sets app, eng and srv to namespace names made of TAG and this shell's
# pid, work to a new temporary directory, and epid and spid (the engine's
# and the server's pids, for the caller to set) to empty; builds the
# topology (router_topology "$app" "$eng" "$srv" N); and on exit, INT or
# TERM stops both processes (router_stop), removes the namespaces, runs the
# function AFTER if given, and removes $work.
router_begin() {
    local tag=$1 n=$2
    app=kt${tag}a$$ eng=kt${tag}e$$ srv=kt${tag}s$$
    work=$(mktemp -d)
    epid="" spid=""
    router_after=${3:-}
    trap router_end EXIT
    trap 'exit 130' INT TERM
    router_topology "$app" "$eng" "$srv" "$n"
}

# router_end: router_begin's exit trap.
router_end() {
    set +e
    router_stop "$epid" "$spid"
    router_teardown "$app" "$eng" "$srv"
    [[ -z $router_after ]] || "$router_after"
    rm -rf "$work"
}

# router_stop ENGINE_PID SERVER_PID
#
# stops the engine (SIGINT, its orderly stop) and the server process, each
# if its pid is set, and waits for them; errors ignored. Call it with errexit
# off (a cleanup trap's `set +e`).
router_stop() {
    [[ -n $1 ]] && kill -INT "$1" 2>/dev/null && wait "$1" 2>/dev/null
    [[ -n $2 ]] && kill "$2" 2>/dev/null && wait "$2" 2>/dev/null
    return 0
}
