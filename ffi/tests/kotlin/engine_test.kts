// End-to-end test of the kerntun FFI from Kotlin on the JVM, through the
// generated (plain, non-Android) bindings and JNA. Run by run.sh inside a
// client network namespace whose veth `args[3]` leads to a server namespace
// running echo_server.py on `args[0]` (IPv4) / `args[1]` (IPv6), port `args[2]`.
//
// Everything runs twice in this one process (two rounds, each with its own
// engine and TUN), plus a second engine alongside the first in round 2.
// Prints "N passed, M failed" and exits non-zero on any failure.

import org.kerntun.*
import java.net.DatagramPacket
import java.net.DatagramSocket
import java.net.InetAddress
import java.net.InetSocketAddress
import java.net.Socket
import java.util.Collections
import java.util.concurrent.TimeUnit
import java.util.concurrent.atomic.AtomicInteger
import kotlin.concurrent.thread
import org.kerntun.testkit.*
import org.kerntun.android.Messages
import org.kerntun.android.Reply

val serverV4 = args[0]
val serverV6 = args[1]
val port = args[2].toInt()
val veth = args[3]

/**
 * A copy of a list that engine threads append to while the test reads it:
 * iterating a `Collections.synchronizedList` without holding its lock throws
 * ConcurrentModificationException when a log line or event arrives meanwhile.
 */
fun <T> MutableList<T>.snap(): List<T> = synchronized(this) { toList() }

/** Run a command; its output is shown only when it fails unexpectedly. */
fun sh(vararg cmd: String, expectFailure: Boolean = false): Int {
    val p = ProcessBuilder(*cmd).redirectErrorStream(true).start()
    val out = p.inputStream.readBytes().decodeToString()
    val done = p.waitFor(10, TimeUnit.SECONDS)
    val rc = if (done) p.exitValue() else -1
    if (rc != 0 && !expectFailure) print(out)
    return rc
}

/** The app's side: what a VpnService/Packet Tunnel would implement. */
class Hooks : PlatformHooks, OwnerHooks {
    val protected = AtomicInteger()
    /** The owners [connectionOwner] names, by the flow's source port. */
    val owners = java.util.concurrent.ConcurrentHashMap<Int, FlowOwner>()
    val ownersAsked = AtomicInteger()
    val logs: MutableList<String> = Collections.synchronizedList(mutableListOf())
    @Volatile var refuse = false
    @Volatile var crash = false

    override fun protect(fd: Int) {
        protected.incrementAndGet()
        if (crash) throw IllegalStateException("undeclared exception from protect")
        if (refuse) throw HookException.Refused("refused by the test")
        // On Linux the engine's sockets are already bound to the veth
        // (direct.interface); Android would call VpnService.protect(fd) here.
    }

    override fun log(level: LogLevel, message: String) {
        logs.add("$level $message")
    }

    // Android answers from getConnectionOwnerUid (KerntunPolicy.kt,
    // ConnectionOwners); here the test names the owner by source port.
    override fun connectionOwner(protocol: FlowProtocol, source: String, destination: String): FlowOwner? {
        ownersAsked.incrementAndGet()
        return owners[source.substringAfterLast(':').toIntOrNull() ?: -1]
    }
}

fun pattern(len: Int, seed: Int) = ByteArray(len) { ((it * 131 + seed * 7 + (it shr 8)) and 0xff).toByte() }

/** Send `len` bytes to the echo server through the TUN; true if all came back intact. */
fun tcpEcho(host: String, len: Int, seed: Int): Boolean {
    Socket().use { s ->
        s.connect(InetSocketAddress(host, port), 5000)
        s.soTimeout = 15000
        val data = pattern(len, seed)
        val writer = thread {
            s.getOutputStream().write(data)
            s.shutdownOutput()
        }
        val got = s.getInputStream().readAllBytes()
        writer.join(15000)
        return got.contentEquals(data)
    }
}

/**
 * Connects [s] through the TUN to the TCP echo and echoes [len] bytes of
 * pattern [seed] on it, checked as [what]; leaves it open and returns its
 * local address as the engine lists it (`ip:port`).
 */
fun echoHeld(s: Socket, len: Int, seed: Int, what: String): String {
    s.connect(InetSocketAddress(serverV4, port), 5000)
    s.soTimeout = 5000
    val data = pattern(len, seed)
    s.getOutputStream().write(data)
    check(s.getInputStream().readNBytes(data.size).contentEquals(data), what)
    return "${s.localAddress.hostAddress}:${s.localPort}"
}

/** Whether a connection through the TUN is refused/reset (not echoed). */
fun tcpFails(host: String, to: Int = port): Boolean = Socket().use { tcpFailsOn(it, host, to, 99) }

/** [tcpFails] on the socket [s] (closed by the caller), sending pattern [seed]. */
fun tcpFailsOn(s: Socket, host: String, to: Int, seed: Int): Boolean = try {
    s.connect(InetSocketAddress(host, to), 5000)
    s.soTimeout = 5000
    s.getOutputStream().write(pattern(1000, seed))
    s.shutdownOutput()
    s.getInputStream().readAllBytes().size != 1000
} catch (e: java.io.IOException) {
    true
}

/** Datagrams of several sizes to the UDP echo; true if each came back intact. */
fun udpEcho(host: String, seed: Int): Boolean {
    DatagramSocket().use { s ->
        s.soTimeout = 2000
        val to = InetSocketAddress(InetAddress.getByName(host), port)
        for ((i, size) in listOf(1, 512, 1400).withIndex()) {
            if (!udpRoundTrip(s, to, pattern(size, seed + i))) return false
        }
        return true
    }
}

/**
 * Sends [data] on [s] to [to]: whether its echo came back intact. The
 * first datagram opens the flow, so a receive that times out (the socket's
 * soTimeout) sends again, up to 3 times; false after the third.
 */
fun udpRoundTrip(s: DatagramSocket, to: InetSocketAddress, data: ByteArray): Boolean {
    for (attempt in 0 until 3) {
        s.send(DatagramPacket(data, data.size, to))
        val buf = ByteArray(2048)
        val p = DatagramPacket(buf, buf.size)
        try {
            s.receive(p)
        } catch (e: java.net.SocketTimeoutException) {
            continue
        }
        return p.length == data.size && buf.copyOf(p.length).contentEquals(data)
    }
    return false
}

/** The HTTP responder echo_server.py runs on the port + 80: groups' probes and latency tests. */
val probeUrl = "http://$serverV4:${port + 80}/generate_204"

/** The rejected port: a rule answers its SYNs with an RST. */
val rejectedPort = port + 1

fun config(tun: String, v4: String, v6: String?, driver: Driver?, stack: Stack? = null) = EngineConfig(
    stack = stack,
    driver = driver,
    tun = TunOptions(name = tun, ipv4 = v4, ipv6 = v6),
    direct = DirectOptions(`interface` = veth),
    rules = listOf(RuleOptions(ports = "$rejectedPort", network = RuleNetwork.TCP, action = RuleAction.Reject)),
    logLevel = LogLevel.DEBUG,
)

fun expectConfigError(what: String, field: String, cfg: EngineConfig, hooks: Hooks) {
    val e = thrown<KerntunException.Config> { Engine.start(cfg, -1, hooks).close() }
    check(e?.field == field, "$what: start fails, KerntunException.Config names field ${e?.field} (want $field): ${e?.reason}")
}

fun round(n: Int) {
    println("--- round $n")
    val hooks = Hooks()
    val tun = "ktun$n"
    val driver = if (n == 1) null else Driver.PER_PACKET
    // Round 1 leaves the stack to the engine (the system stack), round 2
    // asks for smoltcp: the bindings behave the same on both.
    val stack = if (n == 1) null else Stack.SMOLTCP
    val started = System.nanoTime()
    val engine = Engine.start(config(tun, "198.18.0.1/16", "fd00:18::1/64", driver, stack), -1, hooks)
    println("engine started in ${(System.nanoTime() - started) / 1_000_000} ms on ${engine.tunName()}")
    check(engine.isRunning(), "round $n: engine running")
    check(engine.tunName() == tun, "round $n: engine created TUN $tun")
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", tun) == 0, "round $n: route v4 via TUN")
    check(sh("ip", "-6", "route", "replace", "$serverV6/128", "dev", tun) == 0, "round $n: route v6 via TUN")

    val t0 = System.nanoTime()
    val big = 4 shl 20
    check(tcpEcho(serverV4, big, n), "round $n: 4 MiB TCP echo over IPv4 through the TUN")
    val ms = (System.nanoTime() - t0) / 1_000_000
    println("4 MiB echoed (8 MiB through the engine) in $ms ms")
    check(tcpEcho(serverV6, 1 shl 20, n + 10), "round $n: 1 MiB TCP echo over IPv6 through the TUN")
    check(udpEcho(serverV4, n), "round $n: UDP echo over IPv4")
    check(udpEcho(serverV6, n + 20), "round $n: UDP echo over IPv6")

    val protectedBefore = hooks.protected.get()
    check(protectedBefore >= 4, "round $n: protect(fd) called for each outbound socket ($protectedBefore calls)")

    // A refusal from the hook aborts just that connection, typed through HookException.
    hooks.refuse = true
    check(tcpFails(serverV4), "round $n: connection refused when protect throws HookException.Refused")
    hooks.refuse = false
    // An undeclared exception is mapped to HookError.Unexpected: no crash.
    hooks.crash = true
    check(tcpFails(serverV4), "round $n: connection refused when protect throws an undeclared exception")
    hooks.crash = false
    // The failed connects are logged at debug level by the session task, on
    // the engine's runtime threads: the per-engine dispatcher covers them.
    check(hooks.logs.snap().any { it.startsWith("DEBUG") && it.contains("refused by the test") },
        "round $n: logs from the engine's runtime threads reach PlatformHooks.log")
    check(engine.isRunning(), "round $n: engine still running after hook failures")
    val r0 = System.nanoTime()
    check(tcpFails(serverV4, rejectedPort), "round $n: a reject rule refuses port $rejectedPort")
    check((System.nanoTime() - r0) / 1_000_000 < 2000, "round $n: ... at once (RST at SYN time, not a timeout)")
    check(tcpEcho(serverV4, 64 shl 10, n + 30), "round $n: traffic flows again after the hook recovers")
    // The live connection list: an echo held open is listed with its bytes;
    // closing it resets the app's socket and is counted.
    Socket().use { s ->
        val local = echoHeld(s, 10_000, n + 50, "round $n: the held connection echoes")
        var rec: ConnectionRecord? = null
        val deadline = System.nanoTime() + 2_000_000_000L
        while (rec == null && System.nanoTime() < deadline) {
            rec = engine.connections().find { it.source == local && it.bytesUp == 10_000uL && it.bytesDown == 10_000uL }
            if (rec == null) Thread.sleep(10)
        }
        check(rec != null && rec.network == ConnectionNetwork.TCP && rec.destination == "$serverV4:$port" &&
            rec.outbound == "direct" && rec.domainSource == DomainSource.NO_DOMAIN && rec.state == ConnectionState.RELAYING,
            "round $n: connections() lists the held echo as $local (${engine.connections()})")
        check(!engine.closeConnection(ULong.MAX_VALUE), "round $n: closeConnection of an unknown id is false")
        if (rec != null) {
            check(engine.closeConnection(rec.id), "round $n: closeConnection(${rec.id}) is true")
            val reset = thrown<java.net.SocketException> { s.getInputStream().read() }
            check(reset != null, "round $n: the closed connection's socket is reset")
        }
    }
    check(engine.stats().connectionsClosedByHost == 1uL, "round $n: the close is counted")

    val s = engine.stats()
    println("stats: up ${s.tcpBytesUp} B, down ${s.tcpBytesDown} B, sessions ${s.tcpSessionsTotal}, " +
        "udp flows ${s.udpFlowsTotal}, tun reads ${s.tunReads} (${s.tunReadPackets} pkts, max batch ${s.tunReadMaxBatch}), " +
        "driver ${s.driver}, connect failures ${s.tcpConnectFailed}, drops ${s.totalDrops} ${s.drops}")
    val wantStack = if (n == 1) "system" else "smoltcp"
    check(s.stack == wantStack, "round $n: stats.stack = ${s.stack} (want $wantStack)")
    check(s.driver == (if (n == 1) "batch" else "per_packet"), "round $n: stats.driver = ${s.driver}")
    check(s.tcpBytesUp.toLong() >= big + (1 shl 20), "round $n: stats count TCP bytes up (${s.tcpBytesUp})")
    check(s.tcpBytesDown.toLong() >= big + (1 shl 20), "round $n: stats count TCP bytes down (${s.tcpBytesDown})")
    check(s.tcpSessionsTotal >= 3uL, "round $n: stats count TCP sessions (${s.tcpSessionsTotal})")
    check(s.tcpConnectFailed >= 2uL, "round $n: refused protect counted as connect failures (${s.tcpConnectFailed})")
    check(s.tcpRejectedByRule >= 1uL, "round $n: stats count the rule rejection (${s.tcpRejectedByRule})")
    check(s.udpFlowsTotal >= 2uL && s.udpPacketsUp >= 6uL, "round $n: stats count UDP flows and datagrams")
    check(s.tcpBytesSpliced + s.tcpBytesCopied >= (2uL * big.toULong()),
        "round $n: relay bytes counted (spliced ${s.tcpBytesSpliced}, copied ${s.tcpBytesCopied})")
    check(s.packetsUp > 0uL && s.tunReads > 0uL, "round $n: stats count TUN reads")
    check(s.totalDrops == s.drops.sumOf { it.count }, "round $n: total_drops is the sum of drops")
    check(s.memoryPressure == MemoryPressure.NORMAL, "round $n: pressure starts normal")
    // The Android glue hands these to its statistics listeners
    // (KerntunPolicy.kt TunnelStatus); a throwing one does not stop the next.
    val heard = mutableListOf<EngineStats>()
    val throwing = org.kerntun.android.TunnelStatus.StatsListener { throw IllegalStateException("listener bug") }
    val hearing = org.kerntun.android.TunnelStatus.StatsListener { heard.add(it) }
    org.kerntun.android.TunnelStatus.addStatsListener(throwing)
    org.kerntun.android.TunnelStatus.addStatsListener(hearing)
    org.kerntun.android.TunnelStatus.publishStats(s)
    org.kerntun.android.TunnelStatus.removeStatsListener(throwing)
    org.kerntun.android.TunnelStatus.removeStatsListener(hearing)
    check(heard == listOf(s), "round $n: TunnelStatus.publishStats reaches a listener past a throwing one")

    engine.setMemoryPressure(MemoryPressure.CRITICAL)
    val p = engine.stats()
    check(p.memoryPressure == MemoryPressure.CRITICAL && p.admissionLimit < s.admissionLimit,
        "round $n: critical pressure lowers admission (${s.admissionLimit} -> ${p.admissionLimit})")
    engine.setMemoryPressure(MemoryPressure.NORMAL)

    check(hooks.logs.snap().any { it.contains("kerntun started") }, "round $n: engine logs reach PlatformHooks.log (${hooks.logs.size} lines)")

    // Typed errors: nothing is opened for a bad config.
    expectConfigError("round $n: unparsable address", "tun.ipv4", config("ktbad$n", "198.18.0.300/16", null, null), hooks)
    expectConfigError("round $n: no room for the NAT address", "tun.ipv4", config("ktbad$n", "198.18.0.1/31", null, null), hooks)
    expectConfigError("round $n: bad MTU", "tun.mtu",
        config("ktbad$n", "198.18.0.1/16", null, null).copy(tun = TunOptions(name = "ktbad$n", mtu = 500.toUShort())), hooks)
    expectConfigError("round $n: rule naming a missing outbound", "rules[1].action",
        config("ktbad$n", "198.18.0.1/16", null, null).let {
            it.copy(rules = it.rules + RuleOptions(cidr = "203.0.113.0/24", action = RuleAction.Outbound("nope")))
        }, hooks)
    expectConfigError("round $n: domain rule whose list cannot be read", "rules[1]",
        config("ktbad$n", "198.18.0.1/16", null, null).let {
            it.copy(rules = it.rules + RuleOptions(domainSuffix = listOf("example.test"),
                domainList = "/nonexistent/kerntun-list.txt", action = RuleAction.Reject))
        }, hooks)
    expectConfigError("round $n: DNS without upstreams", "dns.upstreams",
        config("ktbad$n", "198.18.0.1/16", null, null).copy(dns = DnsOptions(enabled = true)), hooks)
    expectConfigError("round $n: bad sniff port", "sniff.ports[0]",
        config("ktbad$n", "198.18.0.1/16", null, null).copy(sniff = SniffOptions(ports = listOf("http"))), hooks)
    expectConfigError("round $n: outbound with a bad server address", "outbounds.proxy.server",
        config("ktbad$n", "198.18.0.1/16", null, null).copy(
            outbounds = mapOf("proxy" to Outbound.Socks5(server = "not-an-address", username = null, password = null, udp = OutboundUdp.RELAY)),
        ), hooks)
    val badFd = thrown<KerntunException.Tun> {
        Engine.start(config("ktbad$n", "198.18.0.1/16", null, null), 1_000_000, hooks).close()
    }
    check(badFd != null, "round $n: bad descriptor -> KerntunException.Tun (${badFd?.reason})")
    check(sh("ip", "link", "show", "ktbad$n", expectFailure = true) != 0, "round $n: failed starts leave no device behind")

    if (n == 2) {
        // Several engines per process: a second one beside the first.
        val other = Hooks()
        val second = Engine.start(config("ktun${n}b", "198.18.128.1/17", null, Driver.PER_PACKET), -1, other)
        check(second.isRunning() && engine.isRunning(), "round $n: two engines run side by side")
        check(second.stats().tcpSessionsTotal == 0uL, "round $n: the second engine has its own counters")
        check(other.logs.snap().any { it.contains("ktun${n}b") } && hooks.logs.snap().none { it.contains("ktun${n}b") },
            "round $n: each engine logs to its own hooks")
        second.stop()
        second.close()
        check(engine.isRunning(), "round $n: stopping one engine leaves the other running")
        check(tcpEcho(serverV4, 256 shl 10, n + 40), "round $n: first engine still moves bytes")
    }

    val stopStart = System.nanoTime()
    engine.stop()
    println("engine stopped in ${(System.nanoTime() - stopStart) / 1_000_000} ms")
    engine.stop() // idempotent
    check(!engine.isRunning(), "round $n: engine stopped")
    check(engine.stats().tcpBytesUp >= s.tcpBytesUp, "round $n: stats still answer after stop")
    check(sh("ip", "link", "show", tun, expectFailure = true) != 0, "round $n: TUN $tun removed on stop")
    engine.close()
}

guarded {
    check(version().isNotEmpty(), "version() = ${version()}")
    initLogging(LogLevel.WARN)
    initLogging(LogLevel.INFO) // a second call only changes the level
    check(true, "initLogging installs (and re-levels) the process logger")
    val d = defaultConfig()
    check(d.tun.ipv4 == "198.18.0.1/16" && d.rules.isEmpty(), "defaultConfig() has the documented defaults")
    check(resolverAddresses(d).isEmpty(), "resolverAddresses() is empty while dns is off")
    val withDns = d.copy(
        tun = d.tun.copy(ipv6 = "fd00:18::1/64"),
        dns = d.dns.copy(enabled = true, upstreams = listOf("udp://198.19.0.53:53")),
    )
    check(resolverAddresses(withDns) == listOf("198.18.0.3", "fd00:18::3"),
        "resolverAddresses() names gateway + 2 of each prefix: ${resolverAddresses(withDns)}")
    val invalid = thrown<KerntunException.Config> {
        resolverAddresses(withDns.copy(dns = withDns.dns.copy(upstreams = emptyList())))
    }
    check(invalid?.field == "dns.upstreams", "resolverAddresses() of an invalid config names the bad field: ${invalid?.field}")
    val ss = outboundFromUrl("ss://YWVzLTI1Ni1nY206c2VjcmV0@198.19.1.2:8388#tokyo")
    check(ss == Outbound.Shadowsocks("198.19.1.2:8388", ShadowsocksMethod.AES256_GCM, "secret", OutboundUdp.RELAY),
        "outboundFromUrl() reads an ss:// link: $ss")
    val socks = outboundFromUrl("socks5://me:p%40ss@proxy.example:1080")
    check(socks == Outbound.Socks5("proxy.example:1080", "me", "p@ss", OutboundUdp.RELAY),
        "outboundFromUrl() reads a socks5:// link with a host name: $socks")
    val plugin = thrown<KerntunException.Link> {
        outboundFromUrl("ss://YWVzLTI1Ni1nY206c2VjcmV0@198.19.1.2:8388/?plugin=obfs-local")
    }
    check(plugin != null && plugin.reason.contains("obfs-local") && !plugin.reason.contains("secret"),
        "a plugin link -> KerntunException.Link naming the plugin: ${plugin?.reason}")
    round(1)
    round(2)
}
// ==== begin: calls during stop and close (stats from a second thread) ====
// An app's stats timer keeps calling while another thread stops and closes
// the engine. Every call made before close() must answer without an
// exception and within CALL_BOUND_MS, also while stop drains a busy device
// (hundreds of ms). A call begun after close() meets the generated
// bindings' own use-after-close IllegalStateException ("object has already
// been destroyed"): that is the only exception allowed, and only then.
// close() itself returns at once, even on a running engine (it is then
// stopped on a thread of its own), and the device goes away.
// Through the Android glue's EngineHandle no call throws at all, before,
// during or after close(): after it, "not running" and no statistics.
val CALL_BOUND_MS = 50.0

fun hammerWhileStoppingAndClosing(stopFirst: Boolean, viaHandle: Boolean) {
    val what = (if (stopFirst) "stop() then close()" else "close() of a running engine") +
        (if (viaHandle) " through EngineHandle" else "")
    val tun = "kthammer" + (if (stopFirst) 1 else 2) + (if (viaHandle) 1 else 0)
    val engine = Engine.start(config(tun, "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM), -1, Hooks())
    val handle = if (viaHandle) org.kerntun.android.EngineHandle(engine) else null
    val stats: () -> Any? = if (handle != null) ({ handle.stats() }) else ({ engine.stats() })
    val running: () -> Boolean = if (handle != null) ({ handle.isRunning() }) else ({ engine.isRunning() })
    val error: () -> String? = if (handle != null) ({ handle.error() }) else ({ engine.error() })
    val closedAnswers = AtomicInteger()
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", tun) == 0, "$what: route v4 via $tun")
    // A UDP flood keeps the device busy, so stop drains until its deadline.
    val busy = java.util.concurrent.atomic.AtomicBoolean(true)
    val flood = thread {
        DatagramSocket().use { s ->
            val to = InetSocketAddress(InetAddress.getByName(serverV4), port)
            val d = ByteArray(64)
            while (busy.get()) {
                repeat(10) { s.send(DatagramPacket(d, d.size, to)) }
                Thread.sleep(1)
            }
        }
    }
    val closeAt = java.util.concurrent.atomic.AtomicLong(Long.MAX_VALUE)
    val done = java.util.concurrent.atomic.AtomicBoolean(false)
    val slowestNs = java.util.concurrent.atomic.AtomicLong(0)
    val calls = AtomicInteger()
    val afterClose = AtomicInteger()
    val unexpected: MutableList<String> = Collections.synchronizedList(mutableListOf())
    // Warm up (JIT, JNA) before anything is timed.
    repeat(20) { stats(); running(); error() }
    val hammer = thread {
        var i = 0
        while (!done.get()) {
            val t0 = System.nanoTime()
            try {
                val answer: Any? = when (i++ % 3) {
                    0 -> stats()
                    1 -> running()
                    else -> error()
                }
                slowestNs.accumulateAndGet(System.nanoTime() - t0) { a, b -> maxOf(a, b) }
                calls.incrementAndGet()
                if (t0 >= closeAt.get() && (answer == null || answer == false)) closedAnswers.incrementAndGet()
            } catch (e: IllegalStateException) {
                if (t0 >= closeAt.get() && handle == null) afterClose.incrementAndGet()
                else unexpected.add("${if (t0 >= closeAt.get()) "after" else "before"} close: $e")
            } catch (e: Throwable) {
                unexpected.add(e.toString())
            }
            Thread.sleep(1)
        }
    }
    Thread.sleep(300)
    val callsBeforeStop = calls.get()
    val stopStart = System.nanoTime()
    if (stopFirst) handle?.stop() ?: engine.stop()
    val stopMs = (System.nanoTime() - stopStart) / 1e6
    val callsDuringStop = calls.get() - callsBeforeStop
    closeAt.set(System.nanoTime())
    handle?.close() ?: engine.close()
    val closeMs = (System.nanoTime() - closeAt.get()) / 1e6
    Thread.sleep(100)
    if (handle != null) {
        // Idempotent, and quiet after close.
        try {
            handle.close()
            handle.stop()
            handle.setMemoryPressure(MemoryPressure.CRITICAL)
        } catch (e: Throwable) {
            unexpected.add("handle after close: $e")
        }
    }
    done.set(true)
    hammer.join(5000)
    busy.set(false)
    flood.join(5000)
    val slowestMs = slowestNs.get() / 1e6
    println("$what: stop ${"%.0f".format(stopMs)} ms, close ${"%.1f".format(closeMs)} ms, " +
        "${calls.get()} calls (slowest ${"%.2f".format(slowestMs)} ms), ${afterClose.get()} refused after close, " +
        "${closedAnswers.get()} answered 'closed'")
    check(unexpected.isEmpty(), "$what: no exception from calls made before close() ($unexpected)")
    if (handle != null) {
        check(afterClose.get() == 0, "$what: no call threw after close()")
        check(closedAnswers.get() > 0, "$what: calls after close() answered 'not running' / no stats (${closedAnswers.get()})")
    }
    check(slowestMs < CALL_BOUND_MS, "$what: every call answered within $CALL_BOUND_MS ms (slowest ${"%.1f".format(slowestMs)} ms)")
    if (stopFirst) {
        check(stopMs >= 100, "$what: stop drained a busy device (${"%.0f".format(stopMs)} ms) while being hammered")
        check(callsDuringStop >= 30, "$what: calls kept answering during stop ($callsDuringStop)")
    }
    check(closeMs < CALL_BOUND_MS, "$what: close() returned at once (${"%.1f".format(closeMs)} ms)")
    var gone = false
    for (i in 0 until 250) {
        if (sh("ip", "link", "show", tun, expectFailure = true) != 0) { gone = true; break }
        Thread.sleep(20)
    }
    check(gone, "$what: TUN $tun removed")
}

guarded(" in the stop/close hammer:") {
    for (viaHandle in listOf(false, true)) {
        hammerWhileStoppingAndClosing(stopFirst = true, viaHandle = viaHandle)
        hammerWhileStoppingAndClosing(stopFirst = false, viaHandle = viaHandle)
    }
}
// ==== end: calls during stop and close ====

// ==== begin: a dead engine task, seen at the FFI ====
/** Records the engine's state events (called on the listener's own thread). */
class Listener : EngineListener {
    val events: MutableList<EngineEvent> = Collections.synchronizedList(mutableListOf())
    override fun onEvent(event: EngineEvent) {
        events.add(event)
    }
}

/** [call] on a stopped engine is a typed KerntunException.NotRunning. */
fun checkNotRunning(what: String, call: () -> Unit) {
    val stopped = thrown<KerntunException.NotRunning> { call() }
    check(stopped != null, "$what -> KerntunException.NotRunning (${stopped?.reason})")
}

/** Polls [cond] until it holds or [ms] pass. */
fun waitFor(ms: Long = 3000, cond: () -> Boolean): Boolean {
    val deadline = System.nanoTime() + ms * 1_000_000
    while (!cond()) {
        if (System.nanoTime() > deadline) return false
        Thread.sleep(5)
    }
    return true
}

/**
 * A dead engine task ends the engine visibly: the test-only fault hook
 * (run.sh builds the cdylib with the cargo feature `fault-injection`)
 * makes one task panic or end, and the FFI reports it: isRunning()/error(),
 * the listener's events, the log hook and the engine's ring of recent lines.
 */
fun faults() {
    println("--- faults")
    for ((task, fault, want) in listOf(
        Triple(FaultTask.DRIVER, FaultKind.PANIC, "TUN driver panicked"),
        Triple(FaultTask.ACCEPT_LOOP, FaultKind.END, "accept loop ended unexpectedly"),
    )) {
        val hooks = Hooks()
        val engine = Engine.start(config("ktfault", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM), -1, hooks)
        check(engine.isRunning() && engine.error() == null, "faults: engine running before the $task fault")
        val listener = Listener()
        engine.setListener(listener)
        check(waitFor { listener.events.toList() == listOf(EngineEvent.Running) }, "events: a new listener hears Running: ${listener.events}")
        engine.injectFault(task, fault)
        val deadline = System.nanoTime() + 3_000_000_000L
        while (engine.isRunning() && System.nanoTime() < deadline) Thread.sleep(5)
        check(!engine.isRunning(), "faults: $task $fault -> isRunning() false")
        val err = engine.error()
        check(err != null && err.startsWith(want), "faults: $task $fault -> error() says why: $err")
        check(hooks.logs.snap().any { it.startsWith("ERROR") && it.contains(want) }, "faults: the failure is logged through PlatformHooks.log")
        check(
            waitFor { listener.events.snap().any { it is EngineEvent.Failed && it.reason.startsWith(want) } },
            "events: $task $fault -> Failed with the reason: ${listener.events}",
        )
        check(
            engine.recentLogs().any { it.level == LogLevel.ERROR && it.message.contains(want) },
            "logs: the ring keeps the failure",
        )
        engine.stop()
        check(waitFor { listener.events.snap().lastOrNull() == EngineEvent.Stopped }, "events: Stopped once stop() returned: ${listener.events}")
        check(listener.events.snap().count { it is EngineEvent.Failed } == 1, "events: the failure is said once")
        val late = Listener()
        engine.setListener(late)
        check(waitFor { late.events.toList() == listOf(EngineEvent.Stopped) }, "events: a listener set after stop hears Stopped")
        check(engine.recentLogs().any { it.message.contains(want) }, "logs: the ring still answers after stop")
        check(engine.eventsDropped() == 0UL, "events: none dropped")
        engine.close()
        check(sh("ip", "link", "show", "ktfault", expectFailure = true) != 0, "faults: the failed engine's TUN is removed on stop")
    }
}

/** The engine's log level changes while it runs, for the hook and the ring alike. */
fun logLevels() {
    println("--- log levels")
    val hooks = Hooks()
    val engine = Engine.start(config("ktlog", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM), -1, hooks)
    fun lines() = engine.recentLogs().count { it.message.contains("memory pressure") } to
        hooks.logs.snap().count { it.contains("memory pressure") }
    val before = lines()
    engine.setLogLevel(LogLevel.WARN)
    engine.setMemoryPressure(MemoryPressure.ELEVATED)
    check(lines() == before, "logs: at WARN an info line reaches neither the ring nor the hook: ${lines()} vs $before")
    engine.setLogLevel(LogLevel.INFO)
    engine.setMemoryPressure(MemoryPressure.NORMAL)
    val after = lines()
    check(after.first == before.first + 1 && after.second == before.second + 1, "logs: back at INFO both get it: $after vs $before")
    val r = engine.recentLogs().last { it.message.contains("memory pressure") }
    check(r.level == LogLevel.INFO && r.unixMs > 1_600_000_000_000UL, "logs: a record has its level and time: $r")
    engine.stop()
    engine.close()
}

/**
 * The platform reports a network change: a running engine answers it
 * (true, the listener hears NetworkChanged, traffic still flows on the
 * same uplink, counted once), the same report again is a no-op (false), a
 * DNS server that is not an address is a typed KerntunException.Network
 * naming it, and a stopped engine a typed KerntunException.NotRunning.
 */
fun networkChanges() {
    println("--- network changes")
    val hooks = Hooks()
    val engine = Engine.start(config("ktnet", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM), -1, hooks)
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", "ktnet") == 0, "network: route v4 via TUN")
    val listener = Listener()
    engine.setListener(listener)
    val info = NetworkInfo(
        interfaceName = veth,
        interfaceIndex = 0u,
        hasIpv4 = true,
        hasIpv6 = true,
        dnsServers = listOf("198.19.0.53", "fe80::1%$veth"),
        expensive = false,
        constrained = false,
    )
    check(engine.networkChanged(info), "network: a first report changes something")
    check(
        waitFor { listener.events.contains(EngineEvent.NetworkChanged(veth)) },
        "network: the listener hears NetworkChanged($veth): ${listener.events}",
    )
    check(tcpEcho(serverV4, 64 shl 10, 70), "network: TCP flows on the reported uplink")
    check(!engine.networkChanged(info), "network: the same report again changes nothing")
    val s = engine.stats()
    check(s.networkChanges == 1uL && s.sessionsResetOnNetworkChange == 0uL,
        "network: counted once, nothing reset (${s.networkChanges}, ${s.sessionsResetOnNetworkChange})")
    val badDns = thrown<KerntunException.Network> { engine.networkChanged(info.copy(dnsServers = listOf("not-an-ip"))) }
    check(badDns?.field == "dns_servers[0]", "network: a bad DNS server -> KerntunException.Network names ${badDns?.field}: ${badDns?.reason}")
    check(engine.isRunning(), "network: the engine runs on after the bad report")
    engine.stop()
    checkNotRunning("network: stopped") { engine.networkChanged(info) }
    val handle = org.kerntun.android.EngineHandle(engine)
    check(!handle.networkChanged(info), "network: through EngineHandle a stopped engine answers false")
    handle.close()
    check(!handle.networkChanged(info), "network: ... and so does a closed one")
}

/**
 * Outbound groups: a select group switched with select() (the listener
 * hears GroupSelected, new connections follow: reject refuses them), typed
 * errors for an unknown group, an unknown member and a group that is not a
 * select group; a fallback group probes its member (the HTTP server
 * echo_server.py runs on the port + 80) and groups() shows it healthy,
 * then down and up again with the uplink (the listener hears both);
 * testLatency measures through direct and refuses with typed errors; a
 * group with an unknown member is a Config error naming it.
 */
fun groups() {
    println("--- groups")
    val hooks = Hooks()
    val base = config("ktgrp", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM)
    val cfg = base.copy(
        groups = mapOf(
            "proxy" to GroupOptions(kind = GroupType.SELECT, members = listOf("direct", "reject", "auto"), defaultMember = "direct"),
            "auto" to GroupOptions(kind = GroupType.FALLBACK, members = listOf("direct"), url = probeUrl, intervalMs = 200uL, timeoutMs = 1000uL),
        ),
        rules = base.rules + RuleOptions(ports = "$port", network = RuleNetwork.TCP, action = RuleAction.Outbound("proxy"), name = "to-proxy"),
    )
    val engine = Engine.start(cfg, -1, hooks)
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", "ktgrp") == 0, "groups: route v4 via TUN")
    val listener = Listener()
    engine.setListener(listener)
    fun state(name: String) = engine.groups().first { it.name == name }
    check(state("proxy").selected == "direct" && state("proxy").kind == GroupType.SELECT, "groups: proxy starts on its default: ${engine.groups()}")
    check(tcpEcho(serverV4, 16 shl 10, 80), "groups: TCP through proxy -> direct")
    engine.select("proxy", "reject")
    check(state("proxy").selected == "reject", "groups: select(proxy, reject) is the selection")
    check(waitFor { listener.events.contains(EngineEvent.GroupSelected("proxy", "reject")) }, "groups: the listener hears GroupSelected: ${listener.events}")
    check(tcpFails(serverV4), "groups: new connections are refused through proxy -> reject")
    engine.select("proxy", "auto")
    check(tcpEcho(serverV4, 16 shl 10, 81), "groups: TCP through proxy -> auto -> direct")
    // A connection held open is listed with its rule and its chain of
    // groups; closeConnections by group resets it.
    Socket().use { held ->
        val local = echoHeld(held, 1_000, 82, "groups: the held connection echoes")
        val rec = engine.connections().find { it.source == local }
        check(rec != null && rec.rule == "to-proxy" && rec.chain == listOf("proxy", "auto") && rec.outbound == "direct",
            "groups: the record names the rule and the chain: $rec")
        check(engine.closeConnections(ConnectionFilter(group = "nope")) == 0uL, "groups: a filter on no group closes nothing")
        check(engine.closeConnections(ConnectionFilter(network = ConnectionNetwork.TCP, group = "auto")) == 1uL,
            "groups: closeConnections(group = auto) closes the held connection")
        val reset = thrown<java.net.SocketException> { held.getInputStream().read() }
        check(reset != null, "groups: the closed connection's socket is reset")
        val badIp = thrown<KerntunException.Config> { engine.closeConnections(ConnectionFilter(destinationIp = "not-an-ip")) }
        check(badIp?.field == "destination_ip", "groups: a bad destinationIp is a Config error naming it: $badIp")
    }
    for ((what, call) in listOf<Pair<String, () -> Unit>>(
        "unknown group" to { engine.select("nope", "direct") },
        "unknown member" to { engine.select("proxy", "nope") },
        "not a select group" to { engine.select("auto", "direct") },
    )) {
        val e = thrown<KerntunException> { call() }
        val typed = when (what) {
            "unknown group" -> e is KerntunException.UnknownGroup && e.group == "nope"
            "unknown member" -> e is KerntunException.UnknownMember && e.group == "proxy" && e.member == "nope"
            else -> e is KerntunException.NotSelectGroup && e.kind == "fallback"
        }
        check(typed, "groups: select with an $what -> typed: $e")
    }
    check(
        waitFor { state("auto").members.single().let { it.health == MemberHealth.UP && it.latencyMs != null } },
        "groups: the fallback group's probe finds direct up: ${state("auto")}",
    )
    val ms = engine.testLatency("direct", probeUrl, 2000u)
    check(ms < 1000u, "groups: testLatency(direct) = $ms ms")
    val viaGroup = engine.testLatency("proxy", probeUrl, 2000u)
    check(viaGroup < 1000u, "groups: testLatency(proxy -> auto -> direct) = $viaGroup ms")
    for ((what, call) in listOf<Pair<String, () -> UInt>>(
        "unknown outbound" to { engine.testLatency("nope", probeUrl, 500u) },
        "https URL" to { engine.testLatency("direct", "https://$serverV4/", 500u) },
        "reject" to { engine.testLatency("reject", probeUrl, 500u) },
        "closed port" to { engine.testLatency("direct", "http://$serverV4:${port + 81}/", 500u) },
    )) {
        val e = thrown<KerntunException> { call() }
        val typed = when (what) {
            "unknown outbound" -> e is KerntunException.UnknownOutbound && e.name == "nope"
            "https URL" -> e is KerntunException.InvalidUrl
            else -> e is KerntunException.Unreachable
        }
        check(typed, "groups: testLatency with $what -> typed: $e")
    }
    // The uplink goes down and comes back: the probes see it, the listener
    // hears both changes (the first probe ran before it was set).
    check(sh("ip", "link", "set", veth, "down") == 0, "groups: uplink down")
    check(
        waitFor { listener.events.contains(EngineEvent.OutboundHealth("auto", "direct", false, null)) },
        "groups: the listener hears OutboundHealth(auto, direct, down): ${listener.events}",
    )
    check(state("auto").members.single().health == MemberHealth.DOWN, "groups: groups() shows it down")
    check(sh("ip", "link", "set", veth, "up") == 0, "groups: uplink up")
    check(
        waitFor { listener.events.snap().any { it is EngineEvent.OutboundHealth && it.group == "auto" && it.member == "direct" && it.healthy && it.latencyMs != null } },
        "groups: ... and OutboundHealth(auto, direct, up) with its latency: ${listener.events}",
    )
    engine.stop()
    checkNotRunning("groups: select when stopped") { engine.select("proxy", "direct") }
    check(engine.groups().isEmpty(), "groups: none once stopped")
    engine.close()
    expectConfigError("groups: a member that does not exist", "groups.bad",
        base.copy(groups = mapOf("bad" to GroupOptions(kind = GroupType.SELECT, members = listOf("nowhere")))), hooks)
}

/**
 * The device sleeps and wakes (iOS's provider passes both on): on a running
 * engine sleep() and wake() answer whether they changed anything (twice is
 * a no-op), the periodic ticks (timerTicks) stand still while asleep,
 * traffic flows throughout, a tick comes at once on wake; on a stopped
 * engine both are a typed KerntunException.NotRunning.
 */
fun sleepWake() {
    println("--- sleep and wake")
    val hooks = Hooks()
    val engine = Engine.start(config("ktslp", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM), -1, hooks)
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", "ktslp") == 0, "sleep: route v4 via TUN")
    // A connection leaves a NAT entry to expire: the cleanup ticks once a second.
    check(tcpEcho(serverV4, 16 shl 10, 71), "sleep: TCP flows before")
    check(waitFor { engine.stats().timerTicks >= 2uL }, "sleep: ticks while awake (${engine.stats().timerTicks})")
    check(engine.sleep(), "sleep: a running engine goes to sleep")
    check(!engine.sleep(), "sleep: asleep already, a second sleep changes nothing")
    Thread.sleep(100)
    val asleepAt = engine.stats().timerTicks
    check(tcpEcho(serverV4, 16 shl 10, 72), "sleep: TCP flows while asleep")
    Thread.sleep(1500)
    check(engine.stats().timerTicks == asleepAt, "sleep: no tick in 1.5 s asleep ($asleepAt)")
    check(engine.wake(), "sleep: a sleeping engine wakes")
    check(!engine.wake(), "sleep: awake already, a second wake changes nothing")
    check(waitFor(500) { engine.stats().timerTicks > asleepAt }, "sleep: a tick at once on wake (${engine.stats().timerTicks})")
    check(tcpEcho(serverV4, 16 shl 10, 73), "sleep: TCP flows after wake")
    engine.stop()
    checkNotRunning("sleep: sleep when stopped") { engine.sleep() }
    checkNotRunning("sleep: wake when stopped") { engine.wake() }
    engine.close()
}

/**
 * A running engine takes a new configuration: a rule that rejects the echo
 * port stops new connections to it and a reload without it lets them
 * through again, the engine running throughout (the same TUN); the
 * listener hears Reloaded. A rule naming no outbound is a typed
 * KerntunException.Config naming the field, a new MTU a
 * KerntunException.NeedsRestart naming tun.mtu, and neither changes the
 * routing; a stopped engine is KerntunException.NotRunning.
 */
fun reloads() {
    println("--- reload")
    val hooks = Hooks()
    val cfg = config("ktrel", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM)
    val engine = Engine.start(cfg, -1, hooks)
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", "ktrel") == 0, "reload: route v4 via TUN")
    val listener = Listener()
    engine.setListener(listener)
    check(tcpEcho(serverV4, 16 shl 10, 80), "reload: TCP flows before")
    val rejectEcho = RuleOptions(ports = "$port", network = RuleNetwork.TCP, action = RuleAction.Reject)
    val report = engine.reload(cfg.copy(rules = cfg.rules + rejectEcho))
    check(report.closed == 0uL, "reload: nothing closed: $report")
    check(
        waitFor { listener.events.contains(EngineEvent.Reloaded(0uL)) },
        "reload: the listener hears Reloaded: ${listener.events}",
    )
    check(tcpFails(serverV4), "reload: the new rule rejects the echo port")
    check(engine.isRunning(), "reload: the engine runs on")
    val noOutbound = thrown<KerntunException.Config> {
        engine.reload(cfg.copy(rules = cfg.rules + RuleOptions(action = RuleAction.Outbound("nope"))))
    }
    check(noOutbound?.field == "rules[1].action",
        "reload: a rule naming no outbound -> KerntunException.Config names ${noOutbound?.field}: ${noOutbound?.reason}")
    val newMtu = thrown<KerntunException.NeedsRestart> { engine.reload(cfg.copy(tun = cfg.tun.copy(mtu = 1400u))) }
    check(newMtu?.field == "tun.mtu", "reload: a new MTU -> KerntunException.NeedsRestart names ${newMtu?.field}")
    check(tcpFails(serverV4), "reload: refused reloads left the rule in place")
    engine.reload(cfg)
    check(tcpEcho(serverV4, 16 shl 10, 81), "reload: back to the first rules, TCP flows again")
    check(listener.events.toList().count { it is EngineEvent.Reloaded } == 2, "reload: two reloads heard: ${listener.events}")
    check(engine.stats().reloadClosed == 0uL, "reload: reloadClosed in the stats")
    engine.stop()
    checkNotRunning("reload: stopped") { engine.reload(cfg) }
    engine.close()
}

// ==== begin: the same control as JSON messages (docs/messages.md) ====
// What the app's UI process sends: requests written and replies read with
// the Android module's Messages.kt, through Engine.handleMessage and the
// glue's EngineHandle.handleMessage.
fun messages() {
    println("--- messages")
    val hooks = Hooks()
    val base = config("ktmsg", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM)
    val cfg = base.copy(
        groups = mapOf("proxy" to GroupOptions(kind = GroupType.SELECT, members = listOf("direct", "reject"))),
        rules = base.rules + RuleOptions(ports = "$port", network = RuleNetwork.TCP, action = RuleAction.Outbound("proxy")),
        logLevel = LogLevel.INFO,
    )
    val engine = Engine.start(cfg, -1, hooks)
    val handle = org.kerntun.android.EngineHandle(engine)
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", "ktmsg") == 0, "messages: route v4 via TUN")
    var next = 0L
    fun ask(cmd: String, args: Map<String, Any?> = emptyMap()): Reply {
        val id = ++next
        val r = Messages.reply(handle.handleMessage(Messages.request(cmd, args, id)))
        check(r.id == id, "messages: $cmd: the reply echoes id $id (${r.id})")
        return r
    }
    fun ok(cmd: String, args: Map<String, Any?> = emptyMap()): Map<String, Any?> =
        when (val r = ask(cmd, args)) {
            is Reply.Ok -> r.value
            is Reply.Error -> {
                check(false, "messages: $cmd: $r")
                emptyMap()
            }
        }
    fun err(cmd: String, args: Map<String, Any?> = emptyMap()): Reply.Error? = ask(cmd, args) as? Reply.Error

    val status = ok("status")
    check(status["running"] == true && status["tun_name"] == "ktmsg", "messages: status: $status")
    check(status["message_versions"] == listOf(1L), "messages: status lists v1: $status")

    val stats = ok("stats")
    check(stats["stack"] == "system" && stats["driver"] == "per_packet", "messages: stats names the stack and driver")
    check((stats["dns"] as? Map<*, *>)?.containsKey("queries") == true, "messages: stats carries the DNS counters")

    // groups and select
    @Suppress("UNCHECKED_CAST")
    fun selected() = ((ok("groups")["groups"] as List<Map<String, Any?>>).single { it["name"] == "proxy" })["selected"]
    check(selected() == "direct", "messages: groups: proxy on direct")
    check(tcpEcho(serverV4, 16 shl 10, 90), "messages: TCP through proxy -> direct")
    check(ok("select", mapOf("group" to "proxy", "member" to "reject")).isEmpty(), "messages: select answers {}")
    check(selected() == "reject", "messages: groups: proxy on reject after select")
    check(tcpFails(serverV4), "messages: the selection took effect")
    check(err("select", mapOf("group" to "proxy", "member" to "nope"))?.kind == "unknown_member", "messages: select: unknown_member")
    check(err("select", mapOf("group" to "nope", "member" to "direct"))?.kind == "unknown_group", "messages: select: unknown_group")
    ok("select", mapOf("group" to "proxy", "member" to "direct"))

    // test_latency
    val latency = ok("test_latency", mapOf("outbound" to "direct", "url" to probeUrl, "timeout_ms" to 2000))["latency_ms"]
    check(latency is Long && latency < 1000, "messages: test_latency(direct) = $latency ms")
    check(err("test_latency", mapOf("outbound" to "nope", "url" to probeUrl))?.kind == "unknown_outbound", "messages: test_latency: unknown_outbound")

    // connections and close_connections, on a held connection
    Socket().use { held ->
        val local = echoHeld(held, 1_000, 91, "messages: the held connection echoes")
        val page = ok("connections", mapOf("limit" to 50))
        @Suppress("UNCHECKED_CAST")
        val rec = (page["connections"] as List<Map<String, Any?>>).find { it["source"] == local }
        check(rec != null && rec["network"] == "tcp" && rec["chain"] == listOf("proxy") && rec["outbound"] == "direct" &&
            rec["state"] == "relaying", "messages: connections lists the held one: $rec")
        check(page["truncated"] == false, "messages: connections: not truncated")
        check(ok("connections", mapOf("limit" to 0))["truncated"] == true, "messages: connections: limit 0 truncates")
        val bad = err("close_connections", mapOf("groupp" to "proxy"))
        check(bad?.kind == "bad_request", "messages: close_connections refuses a misspelt filter: $bad")
        check(err("close_connections", mapOf("destination_ip" to "x"))?.field == "destination_ip", "messages: close_connections names destination_ip")
        val closed = ok("close_connections", mapOf("group" to "proxy", "network" to "tcp"))["closed"]
        check(closed == 1L, "messages: close_connections closed the held one: $closed")
        val reset = try {
            held.getInputStream().read() < 0
        } catch (e: java.net.SocketException) {
            true
        }
        check(reset, "messages: the closed connection ends")
        check(ok("close_connection", mapOf("id" to rec?.get("id")))["closed"] == false, "messages: close_connection of a closed one: false")
    }

    // log level and the ring: an info line (a memory pressure change) is
    // kept at info, not at warn
    fun pressureLines() = (ok("recent_logs")["lines"] as List<*>).count { (it as Map<*, *>)["message"].toString().contains("memory pressure") }
    val before = pressureLines()
    check(ok("set_log_level", mapOf("level" to LogLevel.WARN)).isEmpty(), "messages: set_log_level warn answers {}")
    engine.setMemoryPressure(MemoryPressure.ELEVATED)
    check(pressureLines() == before, "messages: at warn the info line is not kept")
    ok("set_log_level", mapOf("level" to "info"))
    engine.setMemoryPressure(MemoryPressure.NORMAL)
    check(pressureLines() == before + 1, "messages: back at info it is kept")
    check(err("set_log_level", mapOf("level" to "loud"))?.kind == "bad_request", "messages: set_log_level: an unknown level is a bad_request")
    @Suppress("UNCHECKED_CAST")
    val lines = ok("recent_logs", mapOf("limit" to 2))["lines"] as List<Map<String, Any?>>
    check(lines.size == 2 && lines.last()["message"].toString().contains("memory pressure") && lines.last()["level"] == "info",
        "messages: recent_logs limit 2: the newest two, oldest first: $lines")

    // reload: only the named sections change
    val report = ok("reload", mapOf("config" to mapOf(
        "rules" to listOf(mapOf("ports" to "$port", "network" to "tcp", "action" to "reject")),
        "groups" to emptyMap<String, Any>(),
    )))
    check(report["closed"] == 0L && report.containsKey("fake_ip_kept"), "messages: reload report: $report")
    check(tcpFails(serverV4), "messages: the reloaded rule rejects the echo port")
    check(ok("groups")["groups"] == emptyList<Any>(), "messages: the reloaded groups are none")
    val restart = err("reload", mapOf("config" to mapOf("tun" to mapOf("name" to "ktmsg", "mtu" to 1400))))
    check(restart?.kind == "needs_restart" && restart.field == "tun.mtu", "messages: reload of tun.mtu: $restart")
    val typo = err("reload", mapOf("config" to mapOf("rulez" to emptyList<Any>())))
    check(typo?.kind == "config" && typo.field == "rulez", "messages: reload names an unknown field: $typo")
    val unknownOutbound = err("reload", mapOf("config" to mapOf("rules" to listOf(mapOf("action" to "nope")))))
    check(unknownOutbound?.kind == "config" && unknownOutbound.field == "rules[0].action", "messages: reload: $unknownOutbound")
    check(tcpFails(serverV4), "messages: refused reloads left the rule in place")
    ok("reload", mapOf("config" to mapOf("rules" to emptyList<Any>())))
    check(tcpEcho(serverV4, 1_000, 93), "messages: reloaded without rules, TCP flows again")
    check(engine.stats().reloadClosed == 0uL, "messages: nothing closed by the reloads")

    // Messages.kt's own writing and reading
    check(Messages.write(mapOf("id" to ULong.MAX_VALUE, "n" to 3u, "l" to LogLevel.WARN, "s" to "a\"b\n\u0001")) ==
        """{"id":18446744073709551615,"n":3,"l":"warn","s":"a\"b\n\u0001"}""", "messages: Messages.write: unsigned, enums, escapes")
    check(Messages.parse(""" {"a":[1,-2.5e1,true,null,"\u00e9\"x"],"b":{}} """) ==
        mapOf("a" to listOf(1L, -25.0, true, null, "\u00e9\"x"), "b" to emptyMap<String, Any?>()), "messages: Messages.parse")
    check(Messages.reply("[]".encodeToByteArray()).let { it is Reply.Error && it.kind == "bad_reply" }, "messages: Messages.reply of a non-reply")

    // envelope errors, as raw bytes
    fun raw(text: String) = Messages.reply(handle.handleMessage(text.encodeToByteArray())) as? Reply.Error
    check(raw("{oops")?.kind == "bad_request", "messages: malformed JSON -> bad_request")
    val v2 = raw("""{"v":2,"id":"x","cmd":"stats"}""")
    check(v2?.kind == "unsupported_version" && v2.id == "x", "messages: v2 -> unsupported_version with the id: $v2")
    check(raw("""{"v":1,"cmd":"fly"}""")?.kind == "unknown_command", "messages: unknown_command")
    check(Messages.reply(handle.handleMessage(ByteArray(2 shl 20) { ' '.code.toByte() }) ).let { it is Reply.Error && it.kind == "too_large" }, "messages: 2 MiB -> too_large")

    // stopped, then closed: answers without an engine
    engine.stop()
    check(ok("status")["running"] == false, "messages: status after stop")
    check(err("select", mapOf("group" to "proxy", "member" to "direct"))?.kind == "not_running", "messages: select after stop: not_running")
    check((ok("stats")["tcp_sessions_total"] as Long) >= 3, "messages: stats after stop keep the final counts")
    handle.close()
    check(ok("status")["running"] == false, "messages: status once closed")
    check(err("stats")?.kind == "not_running", "messages: stats once closed: not_running")
    check(Messages.reply(handleMessageWithoutEngine(Messages.request("groups", id = 99))).let { it is Reply.Error && it.kind == "not_running" && it.id == 99L },
        "messages: handleMessageWithoutEngine: not_running")
}
// ==== end: messages ====

/**
 * Engine.startWithOwner: the hooks' connectionOwner names the app that owns
 * each flow. A connection's record carries the uid and package the hook
 * returned; a `packages` rule rejects the flows of one app (a TCP
 * connection is reset after accept, a UDP flow gets no echo) and not the
 * other's. The lookups are counted.
 */
fun owners() {
    println("--- owners")
    val hooks = Hooks()
    val base = config("ktown", "198.18.0.1/16", null, Driver.PER_PACKET, Stack.SYSTEM)
    val cfg = base.copy(rules = listOf(RuleOptions(packages = listOf("com.example.blocked"), action = RuleAction.Reject, name = "blocked-app")) + base.rules)
    val engine = Engine.startWithOwner(cfg, -1, hooks, hooks)
    check(sh("ip", "route", "replace", "$serverV4/32", "dev", "ktown") == 0, "owners: route v4 via TUN")
    // A socket bound first: its source port is known before it connects,
    // so the hook can name its owner.
    fun bound(owner: FlowOwner): Socket {
        val s = Socket()
        s.bind(InetSocketAddress(0))
        hooks.owners[s.localPort] = owner
        return s
    }
    bound(FlowOwner(10077u, "com.example.owned")).use { s ->
        val local = echoHeld(s, 1_000, 90, "owners: an owned app's connection echoes")
        val rec = engine.connections().find { it.source == local }
        check(rec != null && rec.uid == 10077u && rec.packageName == "com.example.owned" && rec.outbound == "direct",
            "owners: the record carries the uid and package the hook returned: $rec")
    }
    bound(FlowOwner(10078u, "com.example.blocked")).use { s ->
        check(tcpFailsOn(s, serverV4, port, 91), "owners: a packages rule rejects the blocked app's connection")
    }
    check(tcpEcho(serverV4, 16 shl 10, 92), "owners: a connection the hook names no owner for is not matched")
    // UDP: the blocked app's datagrams get no echo, the owned app's do.
    fun udpFrom(owner: FlowOwner): Boolean = DatagramSocket().use { u ->
        hooks.owners[u.localPort] = owner
        u.soTimeout = 1000
        val to = InetSocketAddress(InetAddress.getByName(serverV4), port)
        try {
            udpRoundTrip(u, to, pattern(200, 93))
        } catch (e: java.net.PortUnreachableException) {
            false
        }
    }
    check(udpFrom(FlowOwner(10079u, "com.example.owned")), "owners: an owned app's UDP flow echoes")
    check(!udpFrom(FlowOwner(10080u, "com.example.blocked")), "owners: a packages rule refuses the blocked app's UDP flow")
    val st = engine.stats()
    check(st.ownerLookups >= 5uL && st.ownerFailed == 0uL, "owners: lookups counted (${st.ownerLookups}, failed ${st.ownerFailed})")
    check(hooks.ownersAsked.get() >= 5, "owners: the hook was asked (${hooks.ownersAsked.get()})")
    engine.stop()
    engine.close()
}

guarded(" in the fault checks:") {
    faults()
}
guarded(" in the sleep checks:") {
    sleepWake()
}
guarded(" in the network change checks:") {
    networkChanges()
}
guarded(" in the log level checks:") {
    logLevels()
}
guarded(" in the group checks:") {
    groups()
}
guarded(" in the reload checks:") {
    reloads()
}
guarded(" in the message checks:") {
    messages()
}
guarded(" in the owner checks:") {
    owners()
}
// ==== end: a dead engine task ====

finish()
