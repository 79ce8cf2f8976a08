#!/usr/bin/env bash
# Kotlin-on-JVM end-to-end test of the kerntun FFI.
#
#   bash ffi/tests/kotlin/run.sh        (as root)
#
# Builds the cdylib, generates the plain (JVM) Kotlin bindings with the
# workspace's uniffi-bindgen, compiles them with `kotlinc -Werror` against
# Debian's JNA, then runs engine_test.kts inside a client network namespace
# it creates: a veth pair leads to a server namespace running a TCP+UDP echo
# server. The script starts engines on real TUN devices, moves bytes through
# them, reads stats, checks typed errors and the protect hook, and stops
# them, twice in one JVM; then it makes an engine task panic through the
# test-only fault hook (the cdylib is built with the cargo feature
# `fault-injection`) and checks isRunning()/error(), the listener's
# Running/Failed/Stopped events and the log ring; it reports a network
# change to a running engine (networkChanged: the NetworkChanged event, a
# repeat is a no-op, typed errors for a bad DNS server and a stopped
# engine); it puts an engine to sleep and wakes it (sleep/wake: timerTicks
# stand still while asleep, a tick on wake, traffic throughout, repeats are
# no-ops, NotRunning once stopped); it lists a held TCP echo with
# Engine.connections() and closes it (closeConnection: the socket is
# reset, the close counted); it changes an engine's log level while it
# runs; and it drives outbound groups (select, groups(), testLatency
# against the HTTP responder echo_server.py runs on the port + 80, the
# GroupSelected and OutboundHealth events); it reloads a running engine
# (reload: a new rule takes effect, the Reloaded event, typed refusals
# naming the field, NotRunning once stopped); and it drives the same
# control as JSON messages (Engine.handleMessage through EngineHandle, the
# requests and replies written and read by the Android module's
# Messages.kt: docs/messages.md). Namespaces, the server and
# temp files are removed on every exit. Before that, android_policy_test.kts tests the Android
# module's platform-independent Kotlin (KerntunPolicy.kt) on the same JVM;
# engine_test.kts also hammers the glue's EngineHandle.kt.
#
# KERNTUN_FFI_PROFILE=release-mobile (any cargo profile): the engine test
# loads the cdylib built with that profile the way it ships (`cargo rustc
# --crate-type cdylib`, so LTO runs, still with the fault hook) instead of
# the debug one, e.g. to see that the shipped profile still turns a panic
# into an error (it keeps panic = "unwind"). The bindings come from the
# debug build either way: a stripped library has no symbol table for
# uniffi-bindgen to read, and the interface is the same.
#
# Needs: root, ip (iproute2), python3, Java 17, JNA (apt-get install -y
# libjna-java), the Kotlin compiler (npm install -g kotlin-compiler; its
# kotlinc is not put on PATH, so it is looked up under `npm root -g`).
# Override with KOTLINC=/path/to/kotlinc and JNA_JAR=/path/to/jna.jar.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
cd "$root"

if [[ $(id -u) -ne 0 ]]; then
    echo "SKIPPED: the Kotlin FFI test needs root (network namespaces, TUN)"
    exit 0
fi

KOTLINC=${KOTLINC:-$(command -v kotlinc || true)}
if [[ -z "$KOTLINC" ]] && command -v npm >/dev/null; then
    KOTLINC="$(npm root -g)/kotlin-compiler/bin/kotlinc"
fi
JNA_JAR=${JNA_JAR:-/usr/share/java/jna.jar}
[[ -x "$KOTLINC" ]] || { echo "kotlinc not found: npm install -g kotlin-compiler (or set KOTLINC)" >&2; exit 1; }
[[ -f "$JNA_JAR" ]] || { echo "JNA not found: apt-get install -y libjna-java (or set JNA_JAR)" >&2; exit 1; }
command -v java >/dev/null || { echo "java not found (Java 17 needed)" >&2; exit 1; }

work=$(mktemp -d)
ns_c="ktkotlin-$$-c"
ns_s="ktkotlin-$$-s"
server_pid=""
cleanup() {
    local rc=$?
    # No `set -e` here: every step must run even if an earlier one fails.
    set +e
    if [[ -n "$server_pid" ]]; then
        kill "$server_pid" 2>/dev/null
        wait "$server_pid" 2>/dev/null
    fi
    # Deleting the namespaces also removes the veth pair and any TUN left
    # behind by a crashed engine.
    ip netns del "$ns_c" 2>/dev/null
    ip netns del "$ns_s" 2>/dev/null
    rm -rf "$work"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }
t0=$(date +%s)

step "build the cdylib (with the test-only fault hook) and generate plain Kotlin bindings"
KERNTUN_FFI_FEATURES=fault-injection bash scripts/bindings.sh kotlin "$work/gen"
target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
libdir="$target_dir/debug"
if [[ -n "${KERNTUN_FFI_PROFILE:-}" && $KERNTUN_FFI_PROFILE != dev ]]; then
    step "build the cdylib with the $KERNTUN_FFI_PROFILE profile (and the fault hook)"
    cargo rustc --quiet -p kerntun-ffi --lib --crate-type cdylib --profile "$KERNTUN_FFI_PROFILE" --features fault-injection
    libdir="$target_dir/$KERNTUN_FFI_PROFILE"
fi
[[ -f "$libdir/libkerntun_ffi.so" ]] || { echo "missing $libdir/libkerntun_ffi.so" >&2; exit 1; }

# With them, the Android module's platform-independent Kotlin (no android.*
# import): what the VpnService glue decides is compiled and tested here.
android_src="$root/android/kerntun/src/main/kotlin/org/kerntun/android"
policy="$android_src/KerntunPolicy.kt"
handle="$android_src/EngineHandle.kt"
messages="$android_src/Messages.kt"
step "kotlinc -Werror the generated bindings, $(basename "$policy"), $(basename "$handle") and $(basename "$messages") (JNA $(basename "$(readlink -f "$JNA_JAR")"))"
"$KOTLINC" -Werror -d "$work/kerntun.jar" -classpath "$JNA_JAR" "$work"/gen/org/kerntun/*.kt "$policy" "$handle" "$messages" "$here/Checks.kt" 2>&1

step "android_policy_test.kts (trim levels, app routing, ABIs, state reporting)"
timeout 300 "$KOTLINC" -J-ea -classpath "$work/kerntun.jar:$JNA_JAR" -script "$here/android_policy_test.kts"

step "namespaces $ns_c <-> $ns_s, echo server"
ip netns add "$ns_c"
ip netns add "$ns_s"
ip -n "$ns_c" link set lo up
ip -n "$ns_s" link set lo up
ip -n "$ns_c" link add ktkc type veth peer name ktks netns "$ns_s"
# The engine's IPv6 gateway would otherwise stay tentative (DAD) for a second.
ip netns exec "$ns_c" sysctl -qw net.ipv6.conf.default.accept_dad=0 net.ipv6.conf.all.accept_dad=0
ip -n "$ns_c" addr add 198.19.200.1/24 dev ktkc
ip -n "$ns_c" -6 addr add fd00:19:c8::1/64 dev ktkc nodad
ip -n "$ns_s" addr add 198.19.200.2/24 dev ktks
ip -n "$ns_s" -6 addr add fd00:19:c8::2/64 dev ktks nodad
ip -n "$ns_c" link set ktkc up
ip -n "$ns_s" link set ktks up
ip netns exec "$ns_s" python3 "$here/echo_server.py" 7000 198.19.200.2 fd00:19:c8::2 >"$work/echo.log" 2>&1 &
server_pid=$!
for _ in $(seq 50); do
    grep -q ready "$work/echo.log" 2>/dev/null && break
    sleep 0.1
done
grep -q ready "$work/echo.log" || { echo "echo server did not start:" >&2; cat "$work/echo.log" >&2; exit 1; }

step "engine_test.kts inside $ns_c ($libdir/libkerntun_ffi.so)"
ip netns exec "$ns_c" timeout 600 "$KOTLINC" \
    -J-ea -J-Djna.library.path="$libdir" \
    -classpath "$work/kerntun.jar:$JNA_JAR" \
    -script "$here/engine_test.kts" 198.19.200.2 fd00:19:c8::2 7000 ktkc

step "Kotlin FFI test done in $(( $(date +%s) - t0 )) s"
