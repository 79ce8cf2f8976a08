// The platform-independent part of the Android glue: no android.* import,
// so a plain JVM compiles it (with -Werror) and tests it
// (ffi/tests/kotlin/run.sh runs ffi/tests/kotlin/android_policy_test.kts).
// KerntunVpnService.kt only feeds these functions what Android reports and
// applies what they decide.
//
// * TrimLevel / pressureForTrimLevel / PressureTracker: onTrimMemory and
//   ActivityManager.MemoryInfo -> the engine's MemoryPressure tiers;
// * AppRouting: which apps the VPN covers (allow or deny list), and whether
//   the app itself stays inside its own VPN;
// * PackagedAbis: the ABIs this module ships native code for, and the JNA
//   natives an app must leave out;
// * TunnelState / TunnelStatus: what the service reports to the app, and
//   its statistics to the activities that show them;
// * TickSchedule: how often the service looks at the engine, by whether
//   anybody watches (screen on, statistics listeners);
// * builderStep / splitCidr: typed failures for VpnService.Builder calls;
// * networkInfoFor: the underlying network as Engine.networkChanged takes it;
// * ConnectionOwners: the engine's OwnerHooks from getConnectionOwnerUid and
//   getPackagesForUid (given as functions, so the JVM test stubs them).

package org.kerntun.android

import java.net.Inet4Address
import java.net.Inet6Address
import java.net.InetAddress
import java.net.InetSocketAddress
import java.util.concurrent.ConcurrentHashMap
import java.util.concurrent.CopyOnWriteArrayList
import org.kerntun.EngineStats
import org.kerntun.FlowOwner
import org.kerntun.FlowProtocol
import org.kerntun.MemoryPressure
import org.kerntun.NetworkInfo
import org.kerntun.OwnerHooks
import org.kerntun.Stack

/**
 * The `ComponentCallbacks2.TRIM_MEMORY_*` values (stable API constants,
 * repeated here so that this file needs no Android SDK).
 *
 * Since Android 14 (API 34) only [UI_HIDDEN] and [BACKGROUND] are delivered
 * to `onTrimMemory`; the `RUNNING_*`, [MODERATE] and [COMPLETE] levels
 * arrive on older releases only.
 */
object TrimLevel {
    const val RUNNING_MODERATE = 5
    const val RUNNING_LOW = 10
    const val RUNNING_CRITICAL = 15
    const val UI_HIDDEN = 20
    const val BACKGROUND = 40
    const val MODERATE = 60
    const val COMPLETE = 80
}

/**
 * The engine tier an `onTrimMemory(level)` call asks for, or null when the
 * level says nothing about memory ([TrimLevel.UI_HIDDEN]: the app's UI was
 * hidden, which a VPN app's UI usually is while the tunnel runs).
 *
 * * [TrimLevel.COMPLETE] (before API 34): the process is next to be killed
 *   -> CRITICAL.
 * * [TrimLevel.BACKGROUND] (every API, one of the two still delivered on
 *   34+) and [TrimLevel.MODERATE] (before 34): the process sits in the
 *   background LRU list and the system is reclaiming memory -> ELEVATED.
 * * [TrimLevel.RUNNING_CRITICAL] (before 34): the device is about to kill
 *   background processes to keep this one -> CRITICAL.
 * * [TrimLevel.RUNNING_LOW] and [TrimLevel.RUNNING_MODERATE] (before 34):
 *   the device runs low while this process runs -> ELEVATED.
 * * Unknown levels: the nearest lower known level decides (the levels are
 *   ordered by severity within the running and the background ranges).
 */
fun pressureForTrimLevel(level: Int): MemoryPressure? = when {
    level >= TrimLevel.COMPLETE -> MemoryPressure.CRITICAL
    level >= TrimLevel.BACKGROUND -> MemoryPressure.ELEVATED
    level >= TrimLevel.UI_HIDDEN -> null
    level >= TrimLevel.RUNNING_CRITICAL -> MemoryPressure.CRITICAL
    level >= TrimLevel.RUNNING_MODERATE -> MemoryPressure.ELEVATED
    else -> null
}

/** NORMAL < ELEVATED < CRITICAL, without relying on the generated enum's order. */
internal fun MemoryPressure.rank(): Int = when (this) {
    MemoryPressure.NORMAL -> 0
    MemoryPressure.ELEVATED -> 1
    MemoryPressure.CRITICAL -> 2
}

internal fun higher(a: MemoryPressure, b: MemoryPressure): MemoryPressure = if (a.rank() >= b.rank()) a else b

/**
 * The engine's memory-pressure tier from the two signals Android gives a
 * running service:
 *
 * 1. `onTrimMemory` levels ([onTrim]). No level ever says "recovered" (and
 *    since API 34 only two levels arrive at all), so a tier raised by a trim
 *    event holds for [holdMillis] after the last such event, then decays by
 *    itself. A new event raises the tier (never lowers it) and restarts the
 *    window.
 * 2. `ActivityManager.getMemoryInfo()` ([onMemoryInfo], polled by the
 *    service on every tick of its [TickSchedule]: once a second while
 *    somebody watches, once a minute otherwise): `lowMemory` (the system
 *    considers memory low and starts killing) -> CRITICAL; available memory
 *    below twice the system's `threshold` -> ELEVATED; otherwise NORMAL.
 *    This one is current on every API level, and is the only source of a
 *    CRITICAL tier on API 34+.
 *
 * The tier is the higher of the two. Time comes from the caller
 * (`SystemClock.elapsedRealtime()` on Android, a counter in the tests).
 * Not thread-safe: the service calls it from its main thread only.
 */
class PressureTracker(val holdMillis: Long = DEFAULT_HOLD_MILLIS) {
    private var trimTier: MemoryPressure = MemoryPressure.NORMAL
    private var trimUntil: Long = Long.MIN_VALUE
    private var infoTier: MemoryPressure = MemoryPressure.NORMAL

    /** Feed an onTrimMemory level; returns the resulting tier. */
    fun onTrim(level: Int, nowMillis: Long): MemoryPressure {
        val asked = pressureForTrimLevel(level) ?: return current(nowMillis)
        val held = if (nowMillis < trimUntil) trimTier else MemoryPressure.NORMAL
        trimTier = higher(held, asked)
        trimUntil = nowMillis + holdMillis
        return current(nowMillis)
    }

    /** Feed ActivityManager.MemoryInfo's fields; returns the resulting tier. */
    fun onMemoryInfo(lowMemory: Boolean, availBytes: Long, thresholdBytes: Long, nowMillis: Long): MemoryPressure {
        infoTier = when {
            lowMemory -> MemoryPressure.CRITICAL
            thresholdBytes > 0 && availBytes < 2 * thresholdBytes -> MemoryPressure.ELEVATED
            else -> MemoryPressure.NORMAL
        }
        return current(nowMillis)
    }

    /** The tier now: the held trim tier (until it decays) or the memory-info tier, whichever is higher. */
    fun current(nowMillis: Long): MemoryPressure {
        val trim = if (nowMillis < trimUntil) trimTier else MemoryPressure.NORMAL
        return higher(trim, infoTier)
    }

    companion object {
        /**
         * Five minutes: long enough that a tier raised by a burst of trim
         * events is not dropped between two bursts (Android repeats
         * BACKGROUND while the pressure lasts), short enough that admission
         * does not stay reduced for a tunnel's whole life after one event.
         */
        const val DEFAULT_HOLD_MILLIS: Long = 5 * 60 * 1000
    }
}

/**
 * Which apps the VPN covers. `VpnService.Builder` takes either an allow
 * list (`addAllowedApplication`: only those apps) or a deny list
 * (`addDisallowedApplication`: every app but those), never both.
 *
 * The app itself stays inside its own VPN by default: the engine's
 * outbound sockets leave through `VpnService.protect(fd)`, and the system
 * stack needs the app's UID routed into the TUN (the kernel listener that
 * accepts the rewritten connections lives in the app's process; its replies
 * to the NAT address must go back into the TUN, docs/integration-android.md
 * "Routing"). In allow mode the app's own package is therefore added to the
 * list. [bypassSelf] takes the app's other traffic (UI, API calls) out of the
 * VPN, at the cost spelled out in docs/integration-android.md: the system
 * stack cannot work then, so the engine must run the smoltcp stack.
 */
data class AppRouting(
    val allowed: List<String> = emptyList(),
    val disallowed: List<String> = emptyList(),
    val bypassSelf: Boolean = false,
) {
    enum class Mode { ALL, ALLOW, DENY }

    /** What to hand the Builder: the mode and the packages, the app's own included where it belongs. */
    data class Plan(val mode: Mode, val packages: List<String>)

    /**
     * The Builder calls for [ownPackage], or an [IllegalArgumentException]
     * naming the first problem: both lists set, a malformed package name,
     * or the app's own package in the deny list (use [bypassSelf]).
     */
    fun plan(ownPackage: String): Plan {
        require(allowed.isEmpty() || disallowed.isEmpty()) {
            "appRouting: set allowed or disallowed, not both (VpnService.Builder takes one kind)"
        }
        (allowed + disallowed).forEach { name ->
            require(isPackageName(name)) { "appRouting: \"$name\" is not a package name" }
        }
        require(ownPackage !in disallowed) {
            "appRouting: $ownPackage (this app) is in the deny list; set bypassSelf = true to take it out of the VPN"
        }
        return when {
            allowed.isNotEmpty() -> {
                val list = allowed.filter { it != ownPackage }.distinct()
                Plan(Mode.ALLOW, if (bypassSelf) list else listOf(ownPackage) + list)
            }
            disallowed.isNotEmpty() || bypassSelf -> {
                val list = disallowed.distinct()
                Plan(Mode.DENY, if (bypassSelf) listOf(ownPackage) + list else list)
            }
            else -> Plan(Mode.ALL, emptyList())
        }
    }

    /**
     * The stack the engine may run for [requested] (null: the engine's
     * choice, the system stack on Android). With [bypassSelf] the kernel
     * listener of the system stack sits outside the VPN, so its replies to
     * the NAT address may never reach the TUN: the smoltcp stack is used,
     * and an explicit [Stack.SYSTEM] is refused.
     */
    fun stackFor(requested: Stack?): Stack? {
        if (!bypassSelf) return requested
        require(requested != Stack.SYSTEM) {
            "appRouting: bypassSelf takes the app, and with it the system stack's kernel listener, out of the VPN; " +
                "use Stack.SMOLTCP (or leave stack unset)"
        }
        return Stack.SMOLTCP
    }

    companion object {
        private val segment = Regex("[A-Za-z][A-Za-z0-9_]*")

        /** Android's rule: two or more dot-separated segments, each a letter then letters, digits or '_'. */
        fun isPackageName(name: String): Boolean {
            val parts = name.split('.')
            return parts.size >= 2 && parts.all { segment.matches(it) }
        }

        /**
         * After the Builder calls: an allow list none of whose packages
         * could be added (all uninstalled, [bypassSelf] on) would leave the
         * Builder with no allowed app, and Android then routes EVERY app
         * into the VPN. That is refused: the message to report, or null.
         */
        fun emptyAllowList(plan: Plan, added: Int): String? =
            if (plan.mode == Mode.ALLOW && added == 0) {
                "appRouting: none of the allowed apps is installed (${plan.packages.joinToString()}); " +
                    "an empty allow list would route every app into the VPN"
            } else {
                null
            }
    }
}

/**
 * The ABIs this module ships `libkerntun_ffi.so` for (android/build.sh
 * builds exactly these; scripts/check-android-config.sh checks that
 * android/build.sh, .cargo/config.toml, android/kerntun/build.gradle.kts
 * and this list agree).
 *
 * JNA's AAR carries `libjnidispatch.so` for [JNA_ONLY] as well. An APK with
 * those directories claims the 32-bit ABIs, gets installed on 32-bit-only
 * devices and fails there at the first engine call. Apps set
 * `ndk { abiFilters += listOf("arm64-v8a", "x86_64") }` in their
 * `defaultConfig` (docs/integration-android.md);
 * [unsupported] turns a device that still lacks them into a reported
 * failure instead of a crash.
 */
object PackagedAbis {
    val ABIS: List<String> = listOf("arm64-v8a", "x86_64")
    val JNA_ONLY: List<String> = listOf("armeabi-v7a", "x86")

    /** Null if the device (its `Build.SUPPORTED_ABIS`) runs one of [ABIS]; else why not. */
    fun unsupported(deviceAbis: List<String>): String? =
        if (deviceAbis.any { it in ABIS }) {
            null
        } else {
            "kerntun ships native code for ${ABIS.joinToString()}; this device supports ${deviceAbis.joinToString()}"
        }
}

/** Why the tunnel is not running. */
enum class FailureKind {
    /** `startForeground` was refused (started from the background, or a permission is missing). */
    FOREGROUND,

    /** The device's ABIs are not among [PackagedAbis.ABIS]. */
    UNSUPPORTED_ABI,

    /** The app routing ([AppRouting]) is invalid or would cover every app. */
    APP_ROUTING,

    /** The service's `engineConfig()` threw. */
    CONFIG,

    /** A `VpnService.Builder` call threw (the message names the call). */
    BUILDER,

    /** `establish()` returned null: the VPN was not prepared, or another VPN took over. */
    NOT_PREPARED,

    /** `establish()` threw. */
    ESTABLISH,

    /** The native library or JNA could not be loaded. */
    NATIVE_LIBRARY,

    /** `Engine.start` threw a `KerntunException`. */
    ENGINE_START,

    /** The engine stopped by itself (its `error()` is the message). */
    ENGINE_DIED,

    /** The user or another VPN app revoked the VPN (`onRevoke`). */
    REVOKED,
}

/** The service's state, as reported to the app through [TunnelStatus]. */
sealed class TunnelState {
    data object Stopped : TunnelState()

    data object Starting : TunnelState()

    data class Running(val tunName: String) : TunnelState()

    data class Failed(val kind: FailureKind, val message: String) : TunnelState()
}

/**
 * The state of the app's VPN service, readable and observable from the
 * app's activities in the same process, and its statistics for the ones
 * that show them. The service publishes; listeners are called on the
 * thread that publishes (the service's main thread), in the order they
 * were added. A listener that throws is skipped for that update, never
 * taking the service down.
 */
object TunnelStatus {
    fun interface Listener {
        fun onState(state: TunnelState)
    }

    /**
     * The engine's statistics, once a second while the engine runs. A
     * registered statistics listener counts as somebody watching
     * ([TickSchedule]): register in an activity's `onStart`, remove in its
     * `onStop`. While none is registered and the screen is off, the
     * service does not read the statistics at all.
     */
    fun interface StatsListener {
        fun onStats(stats: EngineStats)
    }

    private val listeners = CopyOnWriteArrayList<Listener>()
    private val statsListeners = CopyOnWriteArrayList<StatsListener>()

    /**
     * Called with the number of statistics listeners after each add and
     * each remove, on the thread that made it. The service sets it while
     * it runs (and hands the count to its main thread).
     */
    @Volatile
    var onStatsListenerCount: ((Int) -> Unit)? = null

    /** How many statistics listeners are registered. */
    val statsListenerCount: Int
        get() = statsListeners.size

    @Volatile
    var state: TunnelState = TunnelState.Stopped
        private set

    /** Adds [listener] and calls it at once with the current state. */
    fun addListener(listener: Listener) {
        listeners.add(listener)
        deliver(listener, state)
    }

    fun removeListener(listener: Listener) {
        listeners.remove(listener)
    }

    /** Called by the service. */
    fun publish(next: TunnelState) {
        state = next
        listeners.forEach { deliver(it, next) }
    }

    /** Adds [listener]; it hears the next statistics the service reads (within a second while the engine runs). */
    fun addStatsListener(listener: StatsListener) {
        statsListeners.add(listener)
        onStatsListenerCount?.invoke(statsListeners.size)
    }

    fun removeStatsListener(listener: StatsListener) {
        if (statsListeners.remove(listener)) onStatsListenerCount?.invoke(statsListeners.size)
    }

    /** Called by the service. */
    fun publishStats(stats: EngineStats) {
        statsListeners.forEach {
            try {
                it.onStats(stats)
            } catch (e: Exception) {
                System.err.println("kerntun: TunnelStatus stats listener threw: $e")
            }
        }
    }

    private fun deliver(listener: Listener, s: TunnelState) {
        try {
            listener.onState(s)
        } catch (e: Exception) {
            // A broken listener must not stop the others or the service.
            System.err.println("kerntun: TunnelStatus listener threw: $e")
        }
    }
}

/**
 * When the service's tick runs, and what it does. Every tick checks that
 * the engine still runs (a dead engine is reported and the VPN torn down,
 * so that traffic does not sink into a TUN nobody reads) and polls the
 * memory info for [PressureTracker]. A tick while somebody watches also
 * reads the statistics, refreshes the notification and hands them to the
 * [TunnelStatus] statistics listeners.
 *
 * Somebody watches while the screen is on (the notification can be pulled
 * down; `PowerManager.isInteractive`, ACTION_SCREEN_ON / ACTION_SCREEN_OFF)
 * or while a statistics listener is registered: the tick then runs every
 * [watchedMillis]. Otherwise every [unwatchedMillis], or not at all when
 * that is null; `onTrimMemory` keeps arriving either way. The engine has
 * no periodic wake-up of its own while idle, so this tick is what an idle
 * tunnel costs.
 *
 * A change to watched asks for a tick now ([delayNow] is 0): the
 * notification shows current numbers as soon as the screen comes on. A
 * change to unwatched moves the next tick to [unwatchedMillis] from now.
 *
 * Not thread-safe: the service calls it from its main thread only.
 */
class TickSchedule(
    val watchedMillis: Long = WATCHED_MILLIS,
    val unwatchedMillis: Long? = UNWATCHED_MILLIS,
) {
    init {
        require(watchedMillis > 0 && (unwatchedMillis == null || unwatchedMillis > 0)) {
            "tick intervals must be positive: watched $watchedMillis, unwatched $unwatchedMillis"
        }
    }

    private var screenOn = true
    private var statsListeners = 0

    /** The screen is on or a statistics listener is registered. */
    val watched: Boolean
        get() = screenOn || statsListeners > 0

    /** The screen turned on or off; true if [watched] changed (then reschedule with [delayNow]). */
    fun onScreen(on: Boolean): Boolean = change { screenOn = on }

    /** The number of statistics listeners is now [count]; true if [watched] changed. */
    fun onStatsListeners(count: Int): Boolean = change { statsListeners = maxOf(0, count) }

    /** The delay of the next tick right after a change: 0 while watched, else [unwatchedMillis] (null: none). */
    fun delayNow(): Long? = if (watched) 0L else unwatchedMillis

    /** The delay of the next tick after one ran (null: none until a change). */
    fun delayAfterTick(): Long? = if (watched) watchedMillis else unwatchedMillis

    private inline fun change(apply: () -> Unit): Boolean {
        val before = watched
        apply()
        return watched != before
    }

    companion object {
        /** Once a second: the notification's byte counters move visibly. */
        const val WATCHED_MILLIS: Long = 1_000

        /**
         * None: while nobody watches the tick stops. The engine reports its
         * own failure (`EngineEvent.Failed`, heard by the service's
         * listener) and `onTrimMemory` keeps arriving, so nothing needs
         * polling. An app that wants the memory info polled anyway sets
         * `unwatchedTickMillis` (once a minute was the old default).
         */
        val UNWATCHED_MILLIS: Long? = null
    }
}

/** A `VpnService.Builder` call that threw: [call] names it ("addAddress(198.18.0.1/16)"). */
class BuilderStepException(val call: String, cause: Throwable) :
    Exception("VpnService.Builder.$call failed: ${cause.message ?: cause::class.java.simpleName}", cause)

/**
 * Runs one Builder call, turning what it may throw (IllegalArgumentException
 * for a bad address or route, IllegalStateException, UnsupportedOperationException
 * when allow and deny lists are mixed, SecurityException) into a
 * [BuilderStepException] that names the call.
 */
inline fun <T> builderStep(call: String, block: () -> T): T =
    try {
        block()
    } catch (e: RuntimeException) {
        throw BuilderStepException(call, e)
    }

/** "198.18.0.1/16" -> ("198.18.0.1", 16); IllegalArgumentException for anything else. */
fun splitCidr(cidr: String): Pair<String, Int> {
    val slash = cidr.indexOf('/')
    require(slash > 0) { "expected address/prefix, got \"$cidr\"" }
    val address = cidr.substring(0, slash)
    val prefix = cidr.substring(slash + 1).toIntOrNull()
    val max = if (address.contains(':')) 128 else 32
    require(prefix != null && prefix in 0..max) { "bad prefix length in \"$cidr\" (0..$max)" }
    return address to prefix
}

/**
 * The underlying network as [org.kerntun.Engine.networkChanged] takes it,
 * from what the network callback reports: the interface
 * (`LinkProperties.interfaceName`, null when the network is lost; the
 * engine binds new direct sockets to it by name), its addresses
 * (`LinkProperties.linkAddresses`: IPv4 if any, IPv6 if any beyond
 * link-local), its DNS servers (`LinkProperties.dnsServers`), whether it is
 * metered (no `NET_CAPABILITY_NOT_METERED`) and whether Data Saver
 * restricts it (`ConnectivityManager.restrictBackgroundStatus`). An
 * interface without addresses reports neither family.
 */
fun networkInfoFor(
    interfaceName: String?,
    interfaceIndex: Int,
    addresses: List<InetAddress>,
    dnsServers: List<InetAddress>,
    metered: Boolean,
    dataSaver: Boolean,
): NetworkInfo = NetworkInfo(
    interfaceName = interfaceName,
    interfaceIndex = if (interfaceName != null && interfaceIndex > 0) interfaceIndex.toUInt() else 0u,
    hasIpv4 = interfaceName != null && addresses.any { it is Inet4Address },
    hasIpv6 = interfaceName != null && addresses.any { it is Inet6Address && !it.isLinkLocalAddress },
    // hostAddress: "8.8.8.8", "fe80::1%wlan0" (the engine drops the scope).
    dnsServers = if (interfaceName == null) emptyList() else dnsServers.mapNotNull { it.hostAddress },
    expensive = interfaceName != null && metered,
    constrained = interfaceName != null && dataSaver,
)

/**
 * `OsConstants.IPPROTO_TCP` / `IPPROTO_UDP` (the Linux protocol numbers;
 * repeated so that this file needs no Android SDK), what
 * `ConnectivityManager.getConnectionOwnerUid` takes.
 */
object IpProto {
    const val TCP = 6
    const val UDP = 17
}

/** `android.os.Process.INVALID_UID`: getConnectionOwnerUid found no such socket. */
const val INVALID_UID = -1

/** `Build.VERSION_CODES.Q`: the first release with getConnectionOwnerUid. */
const val OWNER_LOOKUP_MIN_SDK = 29

/**
 * The engine's [OwnerHooks] (`Engine.startWithOwner`): which app owns a flow.
 *
 * * [ownerUid] is `ConnectivityManager.getConnectionOwnerUid(protocol,
 *   local, remote)` (API 29+; only the active VPN app may call it). Below
 *   [OWNER_LOOKUP_MIN_SDK] there is no such call: every answer is null and
 *   [ownerUid] is never called, so `package` rules never match there.
 *   [INVALID_UID] (no such socket, e.g. it closed already) is null too.
 * * [packagesForUid] is `PackageManager.getPackagesForUid(uid)`; a uid
 *   shared by several packages is named by the first. Its answer is cached
 *   per uid for [cacheMillis] (at most [CACHE_MAX] uids; the map is cleared
 *   when full), so a busy app costs one binder call per flow, not two. An
 *   app reinstalled under another uid is seen within [cacheMillis].
 *
 * The engine calls [connectionOwner] from one thread of its own and waits
 * at most 250 ms; an exception from either function is passed on (the
 * engine counts it as `ownerFailed` and routes the flow without an owner).
 * The addresses come as the engine writes them: `10.0.0.2:40000`,
 * `[fd00::2]:40000`; one it cannot read is answered null.
 */
class ConnectionOwners(
    private val sdkInt: Int,
    private val ownerUid: (protocol: Int, local: InetSocketAddress, remote: InetSocketAddress) -> Int,
    private val packagesForUid: (uid: Int) -> Array<String>?,
    private val nowMillis: () -> Long = System::currentTimeMillis,
    val cacheMillis: Long = DEFAULT_CACHE_MILLIS,
) : OwnerHooks {
    private class Cached(val pkg: String?, val until: Long)

    private val packages = ConcurrentHashMap<Int, Cached>()

    override fun connectionOwner(protocol: FlowProtocol, source: String, destination: String): FlowOwner? {
        if (sdkInt < OWNER_LOOKUP_MIN_SDK) return null
        val local = socketAddress(source) ?: return null
        val remote = socketAddress(destination) ?: return null
        val proto = when (protocol) {
            FlowProtocol.TCP -> IpProto.TCP
            FlowProtocol.UDP -> IpProto.UDP
        }
        val uid = ownerUid(proto, local, remote)
        if (uid < 0) return null
        return FlowOwner(uid.toUInt(), packageOf(uid))
    }

    private fun packageOf(uid: Int): String? {
        val now = nowMillis()
        packages[uid]?.let { if (now < it.until) return it.pkg }
        val pkg = packagesForUid(uid)?.firstOrNull()
        if (packages.size >= CACHE_MAX) packages.clear()
        packages[uid] = Cached(pkg, now + cacheMillis)
        return pkg
    }

    companion object {
        const val DEFAULT_CACHE_MILLIS = 60_000L
        const val CACHE_MAX = 1024
    }
}

/**
 * `10.0.0.2:40000` or `[fd00::2]:40000` (the engine's address text) as a
 * socket address, without a DNS lookup (the host part must be a literal);
 * null for anything else.
 */
fun socketAddress(text: String): InetSocketAddress? {
    val colon = text.lastIndexOf(':')
    if (colon <= 0) return null
    val port = text.substring(colon + 1).toIntOrNull()?.takeIf { it in 0..65535 } ?: return null
    var host = text.substring(0, colon)
    val bracketed = host.startsWith("[") && host.endsWith("]")
    if (bracketed) host = host.substring(1, host.length - 1)
    // A literal only, so getByName never asks DNS: four decimal octets, or
    // (bracketed) IPv6, which getByName parses or refuses without a lookup.
    val literal = if (bracketed) {
        host.contains(':')
    } else {
        host.split('.').let { p -> p.size == 4 && p.all { o -> o.length in 1..3 && o.all(Char::isDigit) && o.toInt() <= 255 } }
    }
    if (!literal) return null
    return try {
        InetSocketAddress(InetAddress.getByName(host), port)
    } catch (e: java.net.UnknownHostException) {
        null
    }
}
