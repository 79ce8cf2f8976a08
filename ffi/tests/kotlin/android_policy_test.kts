// The platform-independent part of the Android glue
// (android/kerntun/src/main/kotlin/org/kerntun/android/KerntunPolicy.kt),
// compiled by run.sh into the same jar as the bindings and tested here on a
// plain JVM: trim levels -> memory pressure (with decay), app routing,
// packaged ABIs, state reporting, the tick schedule (who watches),
// Builder failures, CIDR parsing, the network report for networkChanged,
// the flow owner lookup (ConnectionOwners, with the platform calls stubbed).
// Needs no root, no network and no native library.
// Prints "N passed, M failed" and exits non-zero on any failure.

import java.net.InetAddress
import java.net.InetSocketAddress
import org.kerntun.FlowOwner
import org.kerntun.FlowProtocol
import org.kerntun.MemoryPressure
import org.kerntun.NetworkInfo
import org.kerntun.Stack
import org.kerntun.android.*
import org.kerntun.testkit.*

/** The message of the IllegalArgumentException [block] throws ("" without one), or null when it returns. */
fun throwsIllegalArgument(block: () -> Unit): String? = thrown<IllegalArgumentException>(block)?.let { it.message ?: "" }

val N = MemoryPressure.NORMAL
val E = MemoryPressure.ELEVATED
val C = MemoryPressure.CRITICAL

guarded {
    // --- trim levels
    check(pressureForTrimLevel(TrimLevel.UI_HIDDEN) == null, "UI_HIDDEN (API 34+) carries no memory information")
    check(pressureForTrimLevel(TrimLevel.BACKGROUND) == E, "BACKGROUND (API 34+) -> ELEVATED")
    check(pressureForTrimLevel(TrimLevel.MODERATE) == E, "MODERATE (before 34) -> ELEVATED")
    check(pressureForTrimLevel(TrimLevel.COMPLETE) == C, "COMPLETE (before 34) -> CRITICAL")
    check(pressureForTrimLevel(TrimLevel.RUNNING_MODERATE) == E, "RUNNING_MODERATE (before 34) -> ELEVATED")
    check(pressureForTrimLevel(TrimLevel.RUNNING_LOW) == E, "RUNNING_LOW (before 34) -> ELEVATED")
    check(pressureForTrimLevel(TrimLevel.RUNNING_CRITICAL) == C, "RUNNING_CRITICAL (before 34) -> CRITICAL")
    check(pressureForTrimLevel(0) == null && pressureForTrimLevel(-1) == null, "levels below RUNNING_MODERATE say nothing")
    check(pressureForTrimLevel(50) == E && pressureForTrimLevel(95) == C && pressureForTrimLevel(30) == null,
        "unknown levels take the nearest lower known level")
    // The constants are Android's (ComponentCallbacks2).
    check(listOf(TrimLevel.RUNNING_MODERATE, TrimLevel.RUNNING_LOW, TrimLevel.RUNNING_CRITICAL, TrimLevel.UI_HIDDEN,
        TrimLevel.BACKGROUND, TrimLevel.MODERATE, TrimLevel.COMPLETE) == listOf(5, 10, 15, 20, 40, 60, 80),
        "TrimLevel values are ComponentCallbacks2's")

    // --- the tracker: API 34+ sequence (UI_HIDDEN, BACKGROUND), hold and decay
    val hold = PressureTracker.DEFAULT_HOLD_MILLIS
    val t = PressureTracker()
    check(t.current(0) == N, "tracker starts NORMAL")
    check(t.onTrim(TrimLevel.UI_HIDDEN, 1_000) == N, "UI_HIDDEN leaves the tier alone")
    check(t.onTrim(TrimLevel.BACKGROUND, 2_000) == E, "BACKGROUND raises to ELEVATED")
    check(t.current(2_000 + hold - 1) == E, "ELEVATED holds for the hold window")
    check(t.current(2_000 + hold) == N, "ELEVATED decays to NORMAL after ${hold / 60_000} quiet minutes")
    check(t.onTrim(TrimLevel.BACKGROUND, 10_000_000) == E, "a later BACKGROUND raises again")
    check(t.onTrim(TrimLevel.BACKGROUND, 10_000_000 + hold - 10) == E, "a repeated BACKGROUND restarts the window")
    check(t.current(10_000_000 + hold + 10) == E && t.current(10_000_000 + 2 * hold) == N,
        "... which then decays from the last event")
    // Before API 34: a RUNNING_CRITICAL, then a milder level inside the window, never lowers the tier.
    val old = PressureTracker(holdMillis = 1_000)
    check(old.onTrim(TrimLevel.RUNNING_CRITICAL, 0) == C, "RUNNING_CRITICAL -> CRITICAL")
    check(old.onTrim(TrimLevel.RUNNING_LOW, 500) == C, "a milder level inside the window does not lower the tier")
    check(old.current(1_499) == C && old.current(1_500) == N, "CRITICAL decays one window after the last event")
    // Memory info: the only CRITICAL source on API 34+, current on every API.
    val m = PressureTracker()
    val mib = 1L shl 20
    check(m.onMemoryInfo(false, 2_000 * mib, 200 * mib, 0) == N, "plenty of memory -> NORMAL")
    check(m.onMemoryInfo(false, 300 * mib, 200 * mib, 1) == E, "available below twice the threshold -> ELEVATED")
    check(m.onMemoryInfo(true, 150 * mib, 200 * mib, 2) == C, "lowMemory -> CRITICAL")
    check(m.onTrim(TrimLevel.BACKGROUND, 3) == C, "the higher of trim and memory info wins (CRITICAL over ELEVATED)")
    check(m.onMemoryInfo(false, 2_000 * mib, 200 * mib, 4) == E, "memory recovers, the held trim tier remains")
    check(m.current(3 + hold) == N, "... until it decays")
    check(PressureTracker().onMemoryInfo(false, 100, 0, 5) == N, "a zero threshold (unknown) never raises the tier")

    // --- app routing
    val me = "com.example.vpn"
    check(AppRouting().plan(me) == AppRouting.Plan(AppRouting.Mode.ALL, emptyList()),
        "default: every app, the app itself included (no Builder call)")
    val allow = AppRouting(allowed = listOf("org.mozilla.firefox", "com.android.chrome", "org.mozilla.firefox"))
    check(allow.plan(me) == AppRouting.Plan(AppRouting.Mode.ALLOW, listOf(me, "org.mozilla.firefox", "com.android.chrome")),
        "allow list: the app itself is added so it stays inside its own VPN; duplicates dropped")
    check(AppRouting(allowed = listOf(me, "com.android.chrome")).plan(me).packages == listOf(me, "com.android.chrome"),
        "allow list naming the app itself: listed once")
    check(AppRouting(allowed = listOf("com.android.chrome"), bypassSelf = true).plan(me).packages == listOf("com.android.chrome"),
        "allow list with bypassSelf: the app is left out")
    val deny = AppRouting(disallowed = listOf("com.google.android.gms"))
    check(deny.plan(me) == AppRouting.Plan(AppRouting.Mode.DENY, listOf("com.google.android.gms")),
        "deny list: the app itself is never disallowed")
    check(AppRouting(disallowed = listOf("com.google.android.gms"), bypassSelf = true).plan(me).packages ==
        listOf(me, "com.google.android.gms"), "deny list with bypassSelf: the app is disallowed explicitly")
    check(AppRouting(bypassSelf = true).plan(me) == AppRouting.Plan(AppRouting.Mode.DENY, listOf(me)),
        "bypassSelf alone: deny mode with the app only")
    check(throwsIllegalArgument { AppRouting(allowed = listOf("a.b"), disallowed = listOf("c.d")).plan(me) }
        ?.contains("not both") == true, "allow and deny lists together are refused")
    check(throwsIllegalArgument { AppRouting(disallowed = listOf(me)).plan(me) }?.contains("bypassSelf") == true,
        "the app's own package in the deny list is refused, pointing at bypassSelf")
    for (bad in listOf("", "chrome", "com..chrome", "com.9chrome", "com.chrome.", "com.chrome app")) {
        check(throwsIllegalArgument { AppRouting(allowed = listOf(bad)).plan(me) } != null,
            "malformed package name \"$bad\" is refused")
    }
    check(AppRouting.isPackageName("com.example.my_app2"), "a well-formed package name is accepted")
    check(AppRouting().stackFor(null) == null && AppRouting().stackFor(Stack.SYSTEM) == Stack.SYSTEM,
        "inside its own VPN the requested stack stands")
    check(AppRouting(bypassSelf = true).stackFor(null) == Stack.SMOLTCP, "bypassSelf picks the smoltcp stack")
    check(throwsIllegalArgument { AppRouting(bypassSelf = true).stackFor(Stack.SYSTEM) }?.contains("SMOLTCP") == true,
        "bypassSelf with an explicit system stack is refused")
    val allowPlan = allow.plan(me)
    check(AppRouting.emptyAllowList(allowPlan, 0) != null, "an allow list with nothing added is refused (it would cover every app)")
    check(AppRouting.emptyAllowList(allowPlan, 1) == null, "an allow list with one app added is fine")
    check(AppRouting.emptyAllowList(deny.plan(me), 0) == null, "a deny list with nothing added covers every app, as asked")

    // --- ABIs
    check(PackagedAbis.ABIS == listOf("arm64-v8a", "x86_64"), "packaged ABIs: arm64-v8a, x86_64")
    check(PackagedAbis.ABIS.intersect(PackagedAbis.JNA_ONLY.toSet()).isEmpty(), "JNA-only ABIs are not packaged ones")
    check(PackagedAbis.unsupported(listOf("arm64-v8a", "armeabi-v7a", "armeabi")) == null, "a 64-bit ARM device is supported")
    check(PackagedAbis.unsupported(listOf("x86_64", "x86")) == null, "an x86_64 emulator is supported")
    check(PackagedAbis.unsupported(listOf("armeabi-v7a", "armeabi"))?.contains("armeabi-v7a") == true,
        "a 32-bit-only device is reported, not crashed on")

    // --- state reporting
    val seen = mutableListOf<TunnelState>()
    val broken = TunnelStatus.Listener { throw IllegalStateException("listener bug") }
    TunnelStatus.addListener(broken)
    val listener = TunnelStatus.Listener { seen.add(it) }
    TunnelStatus.addListener(listener)
    check(seen == listOf<TunnelState>(TunnelState.Stopped), "a new listener gets the current state at once")
    TunnelStatus.publish(TunnelState.Starting)
    TunnelStatus.publish(TunnelState.Failed(FailureKind.NOT_PREPARED, "establish() returned null"))
    check(seen.size == 3 && seen[2] == TunnelState.Failed(FailureKind.NOT_PREPARED, "establish() returned null"),
        "listeners see every state, a throwing listener does not stop them")
    check(TunnelStatus.state is TunnelState.Failed, "state holds the last published state")
    TunnelStatus.removeListener(listener)
    TunnelStatus.removeListener(broken)
    TunnelStatus.publish(TunnelState.Running("tun0"))
    check(seen.size == 3, "a removed listener hears nothing more")

    // --- statistics listeners: how many watch, told to the service
    val counts = mutableListOf<Int>()
    TunnelStatus.onStatsListenerCount = { counts.add(it) }
    val a = TunnelStatus.StatsListener { }
    val b = TunnelStatus.StatsListener { }
    TunnelStatus.addStatsListener(a)
    TunnelStatus.addStatsListener(b)
    check(TunnelStatus.statsListenerCount == 2, "two statistics listeners registered")
    TunnelStatus.removeStatsListener(a)
    TunnelStatus.removeStatsListener(a)
    TunnelStatus.removeStatsListener(b)
    check(counts == listOf(1, 2, 1, 0), "each add and remove reports the new count, a repeated remove nothing: $counts")
    TunnelStatus.onStatsListenerCount = null
    TunnelStatus.addStatsListener(a)
    TunnelStatus.removeStatsListener(a)
    check(counts.size == 4 && TunnelStatus.statsListenerCount == 0, "without the service's callback, adding and removing still work")

    // --- the tick schedule: once a second while watched, none otherwise (or what the app asks)
    val stops = TickSchedule()
    stops.onScreen(false)
    check(stops.delayNow() == null && stops.delayAfterTick() == null,
        "by default the tick stops while nobody watches (screen off, no listener)")
    val ts = TickSchedule(unwatchedMillis = 60_000L)
    check(ts.watched && ts.delayAfterTick() == 1_000L, "starts watched (screen on until told otherwise): every second")
    check(ts.onScreen(false), "screen off, no listener: the schedule changes")
    check(!ts.watched && ts.delayNow() == 60_000L && ts.delayAfterTick() == 60_000L,
        "unwatchedMillis = 60 s, nobody watching: the next tick in a minute, then every minute")
    check(!ts.onScreen(false), "a repeated screen-off changes nothing")
    check(ts.onStatsListeners(1) && ts.watched && ts.delayNow() == 0L,
        "a statistics listener with the screen off: watched, tick now")
    check(!ts.onScreen(true) && ts.delayAfterTick() == 1_000L, "screen on while a listener watches: no change, every second")
    check(!ts.onStatsListeners(0) && ts.watched, "the listener leaves, the screen is on: still watched")
    check(ts.onScreen(false) && !ts.watched, "screen off with nobody listening: unwatched")
    check(ts.onScreen(true) && ts.delayNow() == 0L, "screen on again: a tick now (the notification catches up)")
    check(!ts.onStatsListeners(-1) && ts.watched, "a negative count is read as none")
    val never = TickSchedule(unwatchedMillis = null)
    never.onScreen(false)
    check(never.delayNow() == null && never.delayAfterTick() == null, "unwatchedMillis = null: no tick while nobody watches")
    never.onStatsListeners(3)
    check(never.delayNow() == 0L && never.delayAfterTick() == 1_000L, "... and back to every second once somebody does")
    check(throwsIllegalArgument { TickSchedule(watchedMillis = 0) } != null &&
        throwsIllegalArgument { TickSchedule(unwatchedMillis = -5) } != null, "non-positive intervals are refused")

    // --- Builder steps
    val bad = thrown<BuilderStepException> {
        builderStep("addAddress(198.18.0.300/16)") { throw IllegalArgumentException("Bad address") }
    }
    check(bad != null && bad.call == "addAddress(198.18.0.300/16)" && bad.cause is IllegalArgumentException &&
        bad.message!!.contains("Bad address"), "a throwing Builder call becomes BuilderStepException naming it: ${bad?.message}")
    val unnamed = thrown<BuilderStepException> {
        builderStep("addDisallowedApplication(com.a.b)") { throw UnsupportedOperationException() }
    }
    check(unnamed?.message?.contains("UnsupportedOperationException") == true, "an exception without message is named by its class")
    check(builderStep("setMtu(9000)") { 42 } == 42, "builderStep returns the call's value")

    // --- CIDRs
    check(splitCidr("198.18.0.1/16") == ("198.18.0.1" to 16), "splitCidr v4")
    check(splitCidr("fd00:18::1/64") == ("fd00:18::1" to 64), "splitCidr v6")
    for (bad in listOf("198.18.0.1", "/16", "198.18.0.1/33", "fd00::1/129", "198.18.0.1/x")) {
        check(throwsIllegalArgument { splitCidr(bad) } != null, "splitCidr refuses \"$bad\"")
    }

    // --- the network report for Engine.networkChanged
    fun ip(s: String) = InetAddress.getByName(s)
    val cell = networkInfoFor("rmnet_data0", 12, listOf(ip("2001:db8::5"), ip("fe80::1")),
        listOf(ip("2001:db8::53"), ip("fe80::53%1")), metered = true, dataSaver = false)
    check(cell == NetworkInfo("rmnet_data0", 12u, false, true, listOf("2001:db8:0:0:0:0:0:53", "fe80:0:0:0:0:0:0:53%1"), true, false),
        "an IPv6-only metered cellular network: $cell")
    val wifi = networkInfoFor("wlan0", 0, listOf(ip("192.168.1.5"), ip("fe80::2")), listOf(ip("192.168.1.1")),
        metered = false, dataSaver = true)
    check(wifi.hasIpv4 && !wifi.hasIpv6 && wifi.interfaceIndex == 0u && !wifi.expensive && wifi.constrained,
        "IPv4 Wi-Fi with a link-local IPv6 address only, Data Saver on: $wifi")
    val lost = networkInfoFor(null, 7, listOf(ip("192.168.1.5")), listOf(ip("192.168.1.1")), metered = true, dataSaver = true)
    check(lost == NetworkInfo(null, 0u, false, false, emptyList(), false, false), "a lost network reports nothing: $lost")

    // --- flow owners (getConnectionOwnerUid / getPackagesForUid stubbed)
    val asked = mutableListOf<Triple<Int, InetSocketAddress, InetSocketAddress>>()
    var packageCalls = 0
    var clock = 0L
    fun owners(sdk: Int) = ConnectionOwners(
        sdkInt = sdk,
        ownerUid = { proto, local, remote ->
            asked += Triple(proto, local, remote)
            when (local.port) {
                40000 -> 10123
                40001 -> 10124
                else -> INVALID_UID
            }
        },
        packagesForUid = { uid ->
            packageCalls++
            when (uid) {
                10123 -> arrayOf("com.example.app", "com.example.shared")
                else -> null
            }
        },
        nowMillis = { clock },
        cacheMillis = 1_000,
    )
    check(owners(28).connectionOwner(FlowProtocol.TCP, "10.0.0.2:40000", "1.1.1.1:443") == null && asked.isEmpty(),
        "API 28: no owner, getConnectionOwnerUid never called")
    val o = owners(OWNER_LOOKUP_MIN_SDK)
    check(o.connectionOwner(FlowProtocol.TCP, "10.0.0.2:40000", "1.1.1.1:443") == FlowOwner(10123u, "com.example.app"),
        "API 29: the uid and the first of its packages")
    check(asked.last() == Triple(IpProto.TCP, InetSocketAddress(ip("10.0.0.2"), 40000), InetSocketAddress(ip("1.1.1.1"), 443)),
        "TCP is asked as IPPROTO_TCP with both addresses: ${asked.last()}")
    check(o.connectionOwner(FlowProtocol.UDP, "[fd00::2]:40001", "[2001:db8::1]:53") == FlowOwner(10124u, null),
        "IPv6 over UDP; a uid without a package")
    check(asked.last().first == IpProto.UDP && asked.last().second.address == ip("fd00::2"), "UDP as IPPROTO_UDP, IPv6 unbracketed")
    check(o.connectionOwner(FlowProtocol.TCP, "10.0.0.2:40002", "1.1.1.1:443") == null, "INVALID_UID: no owner")
    val callsBefore = packageCalls
    o.connectionOwner(FlowProtocol.TCP, "10.0.0.2:40000", "1.1.1.2:443")
    check(packageCalls == callsBefore, "a uid's package is cached")
    clock += 1_000
    o.connectionOwner(FlowProtocol.TCP, "10.0.0.2:40000", "1.1.1.2:443")
    check(packageCalls == callsBefore + 1, "... for cacheMillis, then asked again")
    val before = asked.size
    for (bad in listOf("10.0.0.2", "example.com:80", "999.0.0.1:80", "10.0.0.2:70000", "[zz::1]:80", ":80")) {
        check(o.connectionOwner(FlowProtocol.TCP, bad, "1.1.1.1:443") == null, "an unreadable address \"$bad\" is no owner")
    }
    check(asked.size == before, "... and never reaches getConnectionOwnerUid (no DNS lookup either)")
    check(socketAddress("[::1]:0") == InetSocketAddress(ip("::1"), 0), "socketAddress reads [::1]:0")
}
finish()
