// A VpnService base class that runs a kerntun engine on the VPN's TUN
// descriptor. Subclass it (see ExampleVpnService) and declare the subclass
// in the app manifest; docs/integration-android.md has the whole recipe.
//
// What it does:
// * Builder settings that agree with the engine config (addresses, v4/v6
//   default routes, DNS, MTU 9000 by default) and the app routing
//   ([appRouting]): the app stays inside its own VPN unless asked otherwise;
// * establish() + detachFd(): the engine duplicates the descriptor, this
//   class closes its own copy once the engine runs;
// * protect(fd) wired to VpnService.protect, so the engine's outbound
//   sockets never loop back into the tunnel;
// * each flow's owning app (uid, package) from getConnectionOwnerUid (API
//   29+) and getPackagesForUid, for the connection list and `package`
//   rules ([ownerHooks], ConnectionOwners in KerntunPolicy.kt);
// * setUnderlyingNetworks fed by a ConnectivityManager network callback,
//   which also tells the engine of every change (Engine.networkChanged:
//   connections stranded on the old network are reset at once, new ones
//   bind to the new interface);
// * onTrimMemory and ActivityManager.MemoryInfo turned into memory pressure;
// * every failure (a Builder call, establish(), the native library, the
//   engine) reported through TunnelStatus, never thrown at the system;
// * a foreground notification with live statistics, a stop action; the
//   statistics are read once a second only while somebody watches (screen
//   on, or a TunnelStatus statistics listener), else a health check runs
//   once a minute (TickSchedule in KerntunPolicy.kt);
// * a clean stop on stop requests, onRevoke and onDestroy;
// * the app's messages (docs/messages.md): bound with Messages.ACTION_MESSAGES,
//   it answers each request through a Messenger with the engine's reply
//   (Engine.handleMessage), off the main thread.
//
// The decisions (trim levels, app routing, ABIs, state) live in
// KerntunPolicy.kt, which has no Android dependency and is compiled and
// tested on the JVM by ffi/tests/kotlin/run.sh. This file needs the Android
// SDK and is not compiled in this repository's CI.

package org.kerntun.android

import android.app.ActivityManager
import android.app.Notification
import android.app.NotificationChannel
import android.app.NotificationManager
import android.app.PendingIntent
import android.content.BroadcastReceiver
import android.content.Context
import android.content.Intent
import android.content.IntentFilter
import android.content.pm.PackageManager
import android.content.pm.ServiceInfo
import android.net.ConnectivityManager
import android.net.LinkProperties
import android.net.Network
import android.net.NetworkCapabilities
import android.net.NetworkRequest
import android.net.VpnService
import android.os.Build
import android.os.Bundle
import android.os.Handler
import android.os.IBinder
import android.os.Looper
import android.os.Message
import android.os.Messenger
import android.os.ParcelFileDescriptor
import android.os.PowerManager
import android.os.RemoteException
import android.os.SystemClock
import android.util.Log
import androidx.core.app.NotificationCompat
import androidx.core.app.ServiceCompat
import java.util.concurrent.ExecutorService
import java.util.concurrent.Executors
import java.util.concurrent.RejectedExecutionException
import org.kerntun.Engine
import org.kerntun.EngineConfig
import org.kerntun.EngineEvent
import org.kerntun.EngineListener
import org.kerntun.HookException
import org.kerntun.KerntunException
import org.kerntun.LogLevel
import org.kerntun.MemoryPressure
import org.kerntun.OwnerHooks
import org.kerntun.PlatformHooks
import org.kerntun.TunOptions
import org.kerntun.handleMessageWithoutEngine
import org.kerntun.resolverAddresses

abstract class KerntunVpnService : VpnService() {
    /**
     * The running engine, if any. Set and cleared on [worker]; safe to call
     * from any thread, also while [worker] stops and closes it (then it
     * reads "not running", never throws; EngineHandle.kt).
     */
    @Volatile
    protected var engine: EngineHandle? = null
        private set

    /** Engine start/stop run here: start blocks until the engine is ready. */
    private val worker: ExecutorService = Executors.newSingleThreadExecutor()
    private val main = Handler(Looper.getMainLooper())

    /**
     * Answers the app's messages off the main thread and apart from
     * [worker] (a message never waits for a start or stop), on two threads:
     * a `test_latency` holds one up to its timeout, the other answers on.
     */
    private val messages: ExecutorService = Executors.newFixedThreadPool(2)
    private val messenger by lazy {
        Messenger(
            Handler(Looper.getMainLooper()) { msg ->
                if (msg.what != Messages.MSG_REQUEST) return@Handler false
                val request = msg.data?.getByteArray(Messages.KEY_REQUEST) ?: ByteArray(0)
                val replyTo = msg.replyTo ?: return@Handler true
                try {
                    messages.execute { answer(request, replyTo) }
                } catch (e: RejectedExecutionException) {
                    // Destroyed meanwhile: the binding is going away too.
                }
                true
            },
        )
    }

    /** Touched on the main thread only. */
    private val pressure = PressureTracker()
    private var pressureSent = MemoryPressure.NORMAL
    private var networkCallback: ConnectivityManager.NetworkCallback? = null
    private val schedule by lazy { TickSchedule(unwatchedMillis = unwatchedTickMillis) }
    private var screenReceiver: BroadcastReceiver? = null

    /** The engine configuration. Keep addresses and MTU in agreement with [configureBuilder]. */
    open fun engineConfig(): EngineConfig = EngineConfig(
        tun = TunOptions(
            // Some devices refuse 65535-byte TUN writes with ENOBUFS; 9000 is the
            // engine's Android default (core/src/budget/mod.rs, `default_mtu`).
            mtu = 9000.toUShort(),
            ipv4 = "198.18.0.1/16",
            ipv6 = "fd00:18::1/64",
        ),
        logLevel = LogLevel.INFO,
    )

    /**
     * Which apps the VPN covers. Default: every app, this one included (its
     * engine sockets leave through protect). See [AppRouting] and the
     * "Routing" section of docs/integration-android.md before setting
     * `bypassSelf`.
     */
    open val appRouting: AppRouting = AppRouting()

    /**
     * DNS servers announced to the system when the engine's DNS service is off
     * (queries are relayed like any UDP flow). With `config.dns.enabled`, the
     * addresses the engine answers on ([resolverAddresses]) are announced instead.
     */
    open val dnsServers: List<String> = listOf("1.1.1.1", "2606:4700:4700::1111")

    /**
     * How often the memory info is polled while nobody watches (screen off,
     * no [TunnelStatus] statistics listener); null (the default): not until
     * somebody watches again. The engine's failure comes as an event
     * either way. See [TickSchedule].
     */
    open val unwatchedTickMillis: Long? = TickSchedule.UNWATCHED_MILLIS

    /** The notification's title and small icon. */
    open val notificationTitle: String = "kerntun"
    open val notificationIcon: Int = android.R.drawable.stat_sys_upload_done

    /**
     * VpnService.Builder settings for [config]: gateway address per family,
     * default routes, DNS, MTU, the app routing. Every call goes through
     * [builderStep], so a refused value surfaces as a [BuilderStepException]
     * naming the call. Returns the packages of the routing that are not
     * installed (skipped and logged; an allow list left empty by them is
     * refused, since Android would then route every app into the VPN).
     */
    open fun configureBuilder(builder: Builder, config: EngineConfig): List<String> {
        builderStep("setSession") { builder.setSession(notificationTitle) }
        val mtu = if (config.tun.mtu.toInt() == 0) 9000 else config.tun.mtu.toInt()
        builderStep("setMtu($mtu)") { builder.setMtu(mtu) }
        config.tun.ipv4?.let { cidr ->
            val (address, prefix) = builderStep("addAddress($cidr)") { splitCidr(cidr) }
            builderStep("addAddress($cidr)") { builder.addAddress(address, prefix) }
            builderStep("addRoute(0.0.0.0/0)") { builder.addRoute("0.0.0.0", 0) }
        }
        config.tun.ipv6?.let { cidr ->
            val (address, prefix) = builderStep("addAddress($cidr)") { splitCidr(cidr) }
            builderStep("addAddress($cidr)") { builder.addAddress(address, prefix) }
            builderStep("addRoute(::/0)") { builder.addRoute("::", 0) }
        }
        val engineResolvers = runCatching { resolverAddresses(config) }.getOrDefault(emptyList())
        engineResolvers.ifEmpty { dnsServers }.forEach { dns ->
            builderStep("addDnsServer($dns)") { builder.addDnsServer(dns) }
        }
        // Until the network callback names one: the system's default network.
        builderStep("setUnderlyingNetworks(null)") { builder.setUnderlyingNetworks(null) }

        val plan = appRouting.plan(packageName)
        val missing = mutableListOf<String>()
        for (pkg in plan.packages) {
            try {
                when (plan.mode) {
                    AppRouting.Mode.ALLOW -> builderStep("addAllowedApplication($pkg)") { builder.addAllowedApplication(pkg) }
                    AppRouting.Mode.DENY -> builderStep("addDisallowedApplication($pkg)") { builder.addDisallowedApplication(pkg) }
                    AppRouting.Mode.ALL -> Unit
                }
            } catch (e: PackageManager.NameNotFoundException) {
                missing += pkg
            }
        }
        return missing
    }

    /** The app's hooks: protect outbound sockets, log to logcat. */
    private val hooks = object : PlatformHooks {
        override fun protect(fd: Int) {
            if (!this@KerntunVpnService.protect(fd)) {
                throw HookException.Refused("VpnService.protect($fd) returned false")
            }
        }

        override fun log(level: LogLevel, message: String) {
            val priority = when (level) {
                LogLevel.ERROR -> Log.ERROR
                LogLevel.WARN -> Log.WARN
                LogLevel.INFO -> Log.INFO
                LogLevel.DEBUG -> Log.DEBUG
                LogLevel.TRACE -> Log.VERBOSE
            }
            Log.println(priority, TAG, message)
        }
    }

    /**
     * Who owns each flow (Engine.startWithOwner): getConnectionOwnerUid on
     * API 29+ (the active VPN app may call it), nothing below (every
     * answer null: `package` rules never match there). Return null to
     * start the engine without owner lookups.
     */
    open fun ownerHooks(): OwnerHooks? {
        val cm = getSystemService(ConnectivityManager::class.java) ?: return null
        val pm = packageManager
        return ConnectionOwners(
            sdkInt = Build.VERSION.SDK_INT,
            ownerUid = { protocol, local, remote ->
                if (Build.VERSION.SDK_INT >= Build.VERSION_CODES.Q) {
                    cm.getConnectionOwnerUid(protocol, local, remote)
                } else {
                    INVALID_UID
                }
            },
            packagesForUid = { uid -> pm.getPackagesForUid(uid) },
            nowMillis = SystemClock::elapsedRealtime,
        )
    }

    override fun onStartCommand(intent: Intent?, flags: Int, startId: Int): Int {
        if (intent?.action == ACTION_STOP) {
            worker.execute {
                stopEngine(TunnelState.Stopped)
                main.post { stopSelf() }
            }
            return START_NOT_STICKY
        }
        try {
            goForeground(notification("starting"))
        } catch (e: RuntimeException) {
            // ForegroundServiceStartNotAllowedException (started from the
            // background, API 31+), SecurityException (a missing permission).
            fail(FailureKind.FOREGROUND, "startForeground was refused: $e")
            return START_NOT_STICKY
        }
        worker.execute { startEngine() }
        return START_STICKY
    }

    /** Publishes [state] on the main thread (TunnelStatus listeners run there). */
    private fun report(state: TunnelState) {
        when (state) {
            is TunnelState.Failed -> Log.e(TAG, "${state.kind}: ${state.message}")
            else -> Log.i(TAG, "state: $state")
        }
        main.post { TunnelStatus.publish(state) }
    }

    /** Reports [kind] and stops the service: the one exit of every failed start. */
    private fun fail(kind: FailureKind, message: String) {
        report(TunnelState.Failed(kind, message))
        main.post { stopSelf() }
    }

    private fun startEngine() {
        if (engine != null) return
        report(TunnelState.Starting)
        PackagedAbis.unsupported(Build.SUPPORTED_ABIS.toList())?.let { return fail(FailureKind.UNSUPPORTED_ABI, it) }

        val config: EngineConfig
        val plan: AppRouting.Plan
        try {
            val requested = engineConfig()
            plan = appRouting.plan(packageName)
            config = requested.copy(stack = appRouting.stackFor(requested.stack))
        } catch (e: IllegalArgumentException) {
            return fail(FailureKind.APP_ROUTING, e.message ?: e.toString())
        } catch (e: RuntimeException) {
            return fail(FailureKind.CONFIG, "engineConfig() threw: $e")
        }

        // configureBuilder touches the native library (resolverAddresses): a
        // missing or unloadable library or JNA is a LinkageError.
        val pfd: ParcelFileDescriptor?
        try {
            val builder = Builder()
            val missing = configureBuilder(builder, config)
            if (missing.isNotEmpty()) Log.w(TAG, "apps not installed, left out of the routing: $missing")
            AppRouting.emptyAllowList(plan, plan.packages.size - missing.size)?.let {
                return fail(FailureKind.APP_ROUTING, it)
            }
            pfd = builder.establish()
        } catch (e: BuilderStepException) {
            return fail(FailureKind.BUILDER, e.message ?: e.toString())
        } catch (e: LinkageError) {
            return fail(FailureKind.NATIVE_LIBRARY, "libkerntun_ffi.so or JNA could not be loaded: $e")
        } catch (e: RuntimeException) {
            // From establish(): IllegalStateException / IllegalArgumentException
            // for settings the system refuses, SecurityException when not prepared.
            return fail(FailureKind.ESTABLISH, "VpnService.Builder.establish() failed: $e")
        }
        if (pfd == null) {
            return fail(FailureKind.NOT_PREPARED, "establish() returned null: VpnService.prepare() not accepted, or another VPN took over")
        }

        val fd = pfd.detachFd()
        try {
            val owners = ownerHooks()
            val started = if (owners != null) Engine.startWithOwner(config, fd, hooks, owners) else Engine.start(config, fd, hooks)
            val handle = EngineHandle(started)
            engine = handle
            // The engine says when it fails on its own (device gone, a task
            // died), on its listener's thread: no polling.
            handle.setListener(object : EngineListener {
                override fun onEvent(event: EngineEvent) {
                    if (event !is EngineEvent.Failed) return
                    worker.execute {
                        if (engine !== handle) return@execute
                        stopEngine(TunnelState.Failed(FailureKind.ENGINE_DIED, event.reason))
                        main.post { stopSelf() }
                    }
                }
            })
            report(TunnelState.Running(started.tunName() ?: "fd $fd"))
            main.post {
                watchNetworks()
                watchWatchers()
                main.post(statsTick)
            }
        } catch (e: KerntunException) {
            fail(FailureKind.ENGINE_START, "engine did not start: ${e.message}")
        } catch (e: RuntimeException) {
            fail(FailureKind.ENGINE_START, "engine did not start: $e")
        } catch (e: LinkageError) {
            fail(FailureKind.NATIVE_LIBRARY, "libkerntun_ffi.so or JNA could not be loaded: $e")
        } finally {
            // The engine works on its own duplicate of the descriptor.
            ParcelFileDescriptor.adoptFd(fd).close()
        }
    }

    /** Stops the engine (on [worker]) and reports [then]. */
    private fun stopEngine(then: TunnelState) {
        main.post {
            main.removeCallbacks(statsTick)
            unwatchNetworks()
            unwatchWatchers()
        }
        engine?.let {
            it.stop()
            it.close()
        }
        engine = null
        report(then)
    }

    /**
     * Tells the system which network the tunnel's traffic really leaves on
     * (for metering, the status bar and apps that check connectivity).
     * The request is for a non-VPN network with internet (NetworkRequest
     * asks for NOT_VPN by default), so the app's own VPN, which covers this
     * app too, is never picked. API 31+: the best matching network; 28-30:
     * requestNetwork; 26-27: the default network, VPNs filtered out.
     */
    private fun watchNetworks() {
        if (networkCallback != null) return
        val cm = getSystemService(ConnectivityManager::class.java) ?: return
        val callback = object : ConnectivityManager.NetworkCallback() {
            private fun use(network: Network?) {
                try {
                    setUnderlyingNetworks(network?.let { arrayOf(it) })
                } catch (e: RuntimeException) {
                    Log.w(TAG, "setUnderlyingNetworks failed: $e")
                }
                tellEngine(cm, network)
            }

            override fun onAvailable(network: Network) {
                val caps = cm.getNetworkCapabilities(network)
                if (caps == null || caps.hasCapability(NetworkCapabilities.NET_CAPABILITY_NOT_VPN)) use(network)
            }

            override fun onCapabilitiesChanged(network: Network, caps: NetworkCapabilities) {
                if (caps.hasCapability(NetworkCapabilities.NET_CAPABILITY_NOT_VPN)) use(network)
            }

            override fun onLinkPropertiesChanged(network: Network, lp: LinkProperties) {
                val caps = cm.getNetworkCapabilities(network)
                if (caps == null || caps.hasCapability(NetworkCapabilities.NET_CAPABILITY_NOT_VPN)) use(network)
            }

            override fun onLost(network: Network) = use(null)
        }
        val request = NetworkRequest.Builder()
            .addCapability(NetworkCapabilities.NET_CAPABILITY_INTERNET)
            .addCapability(NetworkCapabilities.NET_CAPABILITY_NOT_RESTRICTED)
            .build()
        try {
            when {
                Build.VERSION.SDK_INT >= 31 -> cm.registerBestMatchingNetworkCallback(request, callback, main)
                Build.VERSION.SDK_INT >= 28 -> cm.requestNetwork(request, callback, main)
                else -> cm.registerDefaultNetworkCallback(callback, main)
            }
            networkCallback = callback
        } catch (e: RuntimeException) {
            // SecurityException / TooManyRequestsException: the tunnel runs
            // on with the system default as its underlying network.
            Log.w(TAG, "network callback not registered: $e")
        }
    }

    /**
     * Tells the engine which network its outbound sockets leave on now
     * (on the main thread: the call reads the interfaces' addresses and
     * returns; the resets happen on the engine's threads). The engine
     * ignores a report that changes nothing, so every callback may call it.
     */
    private fun tellEngine(cm: ConnectivityManager, network: Network?) {
        val handle = engine ?: return
        val lp = network?.let { cm.getLinkProperties(it) }
        val caps = network?.let { cm.getNetworkCapabilities(it) }
        val name = lp?.interfaceName
        val index = try {
            name?.let { java.net.NetworkInterface.getByName(it)?.index } ?: 0
        } catch (e: java.net.SocketException) {
            0
        }
        val info = networkInfoFor(
            interfaceName = name,
            interfaceIndex = index,
            addresses = lp?.linkAddresses?.map { it.address } ?: emptyList(),
            dnsServers = lp?.dnsServers ?: emptyList(),
            metered = caps?.hasCapability(NetworkCapabilities.NET_CAPABILITY_NOT_METERED) == false,
            dataSaver = cm.restrictBackgroundStatus == ConnectivityManager.RESTRICT_BACKGROUND_STATUS_ENABLED,
        )
        try {
            if (handle.networkChanged(info)) Log.i(TAG, "network changed: ${name ?: "none"}")
        } catch (e: KerntunException) {
            Log.w(TAG, "networkChanged: $e")
        }
    }

    private fun unwatchNetworks() {
        val callback = networkCallback ?: return
        networkCallback = null
        try {
            getSystemService(ConnectivityManager::class.java)?.unregisterNetworkCallback(callback)
        } catch (e: RuntimeException) {
            Log.w(TAG, "unregisterNetworkCallback: $e")
        }
    }

    /**
     * The memory info on every tick; the statistics (notification,
     * listeners) only while somebody watches. Its pace comes from
     * [schedule]. (The engine's failure arrives as an event, see
     * [startEngine].)
     */
    private val statsTick = object : Runnable {
        override fun run() {
            val e = engine ?: return
            if (!e.isRunning()) return
            pollMemoryInfo()
            if (schedule.watched) {
                val s = e.stats() ?: return
                val text = "↑ ${human(s.tcpBytesUp + s.udpBytesUp)}  ↓ ${human(s.tcpBytesDown + s.udpBytesDown)}  " +
                    "· ${s.tcpSessionsActive} TCP · ${s.udpFlowsActive} UDP"
                getSystemService(NotificationManager::class.java).notify(NOTIFICATION_ID, notification(text))
                TunnelStatus.publishStats(s)
            }
            schedule.delayAfterTick()?.let { main.postDelayed(this, it) }
        }
    }

    /** After a change of who watches: the next tick as [schedule] says (main thread). */
    private fun reschedule() {
        main.removeCallbacks(statsTick)
        if (engine == null) return
        schedule.delayNow()?.let { main.postDelayed(statsTick, it) }
    }

    /**
     * Follows what [schedule] needs: the screen's interactive state
     * (ACTION_SCREEN_ON/OFF reach context-registered receivers only; they
     * are system broadcasts, so no export flag is needed) and the number
     * of [TunnelStatus] statistics listeners. Main thread.
     */
    private fun watchWatchers() {
        TunnelStatus.onStatsListenerCount = { count -> main.post { if (schedule.onStatsListeners(count)) reschedule() } }
        schedule.onStatsListeners(TunnelStatus.statsListenerCount)
        if (screenReceiver != null) return
        val receiver = object : BroadcastReceiver() {
            override fun onReceive(context: Context, intent: Intent) {
                val on = when (intent.action) {
                    Intent.ACTION_SCREEN_ON -> true
                    Intent.ACTION_SCREEN_OFF -> false
                    else -> return
                }
                if (schedule.onScreen(on)) reschedule()
            }
        }
        val filter = IntentFilter().apply {
            addAction(Intent.ACTION_SCREEN_ON)
            addAction(Intent.ACTION_SCREEN_OFF)
        }
        try {
            registerReceiver(receiver, filter)
            screenReceiver = receiver
            schedule.onScreen(getSystemService(PowerManager::class.java)?.isInteractive ?: true)
        } catch (e: RuntimeException) {
            // Without it the screen counts as on: once a second, as before.
            schedule.onScreen(true)
            Log.w(TAG, "screen state receiver not registered: $e")
        }
    }

    private fun unwatchWatchers() {
        TunnelStatus.onStatsListenerCount = null
        val receiver = screenReceiver ?: return
        screenReceiver = null
        try {
            unregisterReceiver(receiver)
        } catch (e: IllegalArgumentException) {
            Log.w(TAG, "unregisterReceiver: $e")
        }
    }

    private fun pollMemoryInfo() {
        val am = getSystemService(ActivityManager::class.java) ?: return
        val info = ActivityManager.MemoryInfo()
        am.getMemoryInfo(info)
        applyPressure(pressure.onMemoryInfo(info.lowMemory, info.availMem, info.threshold, SystemClock.elapsedRealtime()))
    }

    private fun applyPressure(tier: MemoryPressure) {
        if (tier == pressureSent) return
        pressureSent = tier
        Log.i(TAG, "memory pressure: $tier")
        engine?.setMemoryPressure(tier)
    }

    /**
     * Android 14+ delivers only UI_HIDDEN and BACKGROUND here; older
     * releases the RUNNING_* levels too. [PressureTracker] maps them and
     * lets a raised tier decay (KerntunPolicy.kt).
     */
    override fun onTrimMemory(level: Int) {
        super.onTrimMemory(level)
        val now = SystemClock.elapsedRealtime()
        main.post { applyPressure(pressure.onTrim(level, now)) }
    }

    /**
     * The system binds with [VpnService.SERVICE_INTERFACE]; the app's own
     * activities bind with [Messages.ACTION_MESSAGES] and send
     * [Messages.MSG_REQUEST] messages (docs/integration-android.md).
     */
    override fun onBind(intent: Intent?): IBinder? =
        if (intent?.action == Messages.ACTION_MESSAGES) messenger.binder else super.onBind(intent)

    private fun answer(request: ByteArray, replyTo: Messenger) {
        val reply = engine?.handleMessage(request) ?: handleMessageWithoutEngine(request)
        val msg = Message.obtain(null, Messages.MSG_REPLY)
        msg.data = Bundle().apply { putByteArray(Messages.KEY_REPLY, reply) }
        try {
            replyTo.send(msg)
        } catch (e: RemoteException) {
            // The app went away meanwhile: nobody to answer.
        }
    }

    override fun onRevoke() {
        // Another VPN took over, or the user revoked the permission.
        worker.execute {
            stopEngine(TunnelState.Failed(FailureKind.REVOKED, "the VPN was revoked (another VPN app, or the user)"))
            main.post { stopSelf() }
        }
    }

    override fun onDestroy() {
        worker.execute {
            if (engine != null) stopEngine(TunnelState.Stopped)
        }
        worker.shutdown()
        messages.shutdown()
        super.onDestroy()
    }

    private fun goForeground(n: Notification) {
        val type = if (Build.VERSION.SDK_INT >= 34) ServiceInfo.FOREGROUND_SERVICE_TYPE_SYSTEM_EXEMPTED else 0
        ServiceCompat.startForeground(this, NOTIFICATION_ID, n, type)
    }

    private fun notification(text: String): Notification {
        val nm = getSystemService(NotificationManager::class.java)
        if (nm.getNotificationChannel(CHANNEL) == null) {
            nm.createNotificationChannel(
                NotificationChannel(CHANNEL, notificationTitle, NotificationManager.IMPORTANCE_LOW),
            )
        }
        val stop = PendingIntent.getService(
            this,
            0,
            Intent(this, javaClass).setAction(ACTION_STOP),
            PendingIntent.FLAG_IMMUTABLE,
        )
        return NotificationCompat.Builder(this, CHANNEL)
            .setSmallIcon(notificationIcon)
            .setContentTitle(notificationTitle)
            .setContentText(text)
            .setOngoing(true)
            .setOnlyAlertOnce(true)
            .addAction(0, "Stop", stop)
            .build()
    }

    companion object {
        const val ACTION_STOP = "org.kerntun.android.STOP"
        private const val TAG = "kerntun"
        private const val CHANNEL = "kerntun"
        private const val NOTIFICATION_ID = 0x6b74

        fun human(bytes: ULong): String {
            val b = bytes.toDouble()
            return when {
                b >= 1e9 -> "%.2f GB".format(b / 1e9)
                b >= 1e6 -> "%.1f MB".format(b / 1e6)
                b >= 1e3 -> "%.0f kB".format(b / 1e3)
                else -> "$bytes B"
            }
        }
    }
}
