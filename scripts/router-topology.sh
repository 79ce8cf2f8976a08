# Sourced by scripts/phone-perf.sh and scripts/udp-down-callgrind.sh: what
# they need before they start, and the phone profiles' router topology in
# three namespaces.
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
