// A VpnService base class that runs a kerntun engine on the VPN's TUN
// descriptor. Subclass it (see ExampleVpnService) and declare the subclass
// in the app manifest; docs/integration-android.md has the whole recipe.
//
// What it does:
// * Builder settings that agree with the engine config (addresses, v4/v6
//   default routes, DNS, MTU 9000 by default), the app itself excluded;
// * establish() + detachFd(): the engine duplicates the descriptor, this
//   class closes its own copy once the engine runs;
// * protect(fd) wired to VpnService.protect, so the engine's outbound
//   sockets never loop back into the tunnel;
// * onTrimMemory forwarded as memory pressure;
// * a foreground notification with live statistics, a stop action;
// * a clean stop on stop requests, onRevoke and onDestroy.
//
// This module is not compiled in this repository's CI (no Android SDK
// there); the generated bindings it uses are compiled and run on the JVM.

package org.kerntun.android

import android.app.Notification
import android.app.NotificationChannel
import android.app.NotificationManager
import android.app.PendingIntent
import android.content.ComponentCallbacks2
import android.content.Intent
import android.content.pm.ServiceInfo
import android.net.VpnService
import android.os.Build
import android.os.Handler
import android.os.Looper
import android.os.ParcelFileDescriptor
import android.util.Log
import androidx.core.app.NotificationCompat
import androidx.core.app.ServiceCompat
import java.util.concurrent.ExecutorService
import java.util.concurrent.Executors
import org.kerntun.Engine
import org.kerntun.EngineConfig
import org.kerntun.HookException
import org.kerntun.KerntunException
import org.kerntun.LogLevel
import org.kerntun.MemoryPressure
import org.kerntun.PlatformHooks
import org.kerntun.TunOptions
import org.kerntun.resolverAddresses

abstract class KerntunVpnService : VpnService() {
    /** The running engine, if any. Touched only on [worker]. */
    @Volatile
    protected var engine: Engine? = null
        private set

    /** Engine start/stop run here: start blocks until the engine is ready. */
    private val worker: ExecutorService = Executors.newSingleThreadExecutor()
    private val main = Handler(Looper.getMainLooper())

    /** The engine configuration. Keep addresses and MTU in agreement with [configureBuilder]. */
    open fun engineConfig(): EngineConfig = EngineConfig(
        tun = TunOptions(
            // Some devices return ENOBUFS at 65535; 9000 is what peers settled on.
            mtu = 9000.toUShort(),
            ipv4 = "198.18.0.1/16",
            ipv6 = "fd00:18::1/64",
        ),
        logLevel = LogLevel.INFO,
    )

    /**
     * DNS servers announced to the system when the engine's DNS service is off
     * (queries are relayed like any UDP flow). With `config.dns.enabled`, the
     * addresses the engine answers on ([resolverAddresses]) are announced instead.
     */
    open val dnsServers: List<String> = listOf("1.1.1.1", "2606:4700:4700::1111")

    /** The notification's title and small icon. */
    open val notificationTitle: String = "kerntun"
    open val notificationIcon: Int = android.R.drawable.stat_sys_upload_done

    /** VpnService.Builder settings for [config]: gateway address per family, default routes, DNS, MTU. */
    open fun configureBuilder(builder: Builder, config: EngineConfig) {
        builder.setSession(notificationTitle)
        builder.setMtu(if (config.tun.mtu.toInt() == 0) 9000 else config.tun.mtu.toInt())
        config.tun.ipv4?.let { cidr ->
            val (address, prefix) = split(cidr)
            builder.addAddress(address, prefix)
            builder.addRoute("0.0.0.0", 0)
        }
        config.tun.ipv6?.let { cidr ->
            val (address, prefix) = split(cidr)
            builder.addAddress(address, prefix)
            builder.addRoute("::", 0)
        }
        val engineResolvers = runCatching { resolverAddresses(config) }.getOrDefault(emptyList())
        engineResolvers.ifEmpty { dnsServers }.forEach { builder.addDnsServer(it) }
        // The app's own traffic (UI, API calls) stays outside the tunnel.
        builder.addDisallowedApplication(packageName)
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

    override fun onStartCommand(intent: Intent?, flags: Int, startId: Int): Int {
        if (intent?.action == ACTION_STOP) {
            worker.execute {
                stopEngine()
                main.post { stopSelf() }
            }
            return START_NOT_STICKY
        }
        goForeground(notification("starting"))
        worker.execute { startEngine() }
        return START_STICKY
    }

    private fun startEngine() {
        if (engine != null) return
        val config = engineConfig()
        val builder = Builder()
        configureBuilder(builder, config)
        val pfd: ParcelFileDescriptor? = builder.establish()
        if (pfd == null) {
            // Not prepared (VpnService.prepare() was not accepted) or revoked.
            Log.e(TAG, "VpnService.Builder.establish() returned null")
            main.post { stopSelf() }
            return
        }
        val fd = pfd.detachFd()
        try {
            engine = Engine.start(config, fd, hooks)
            Log.i(TAG, "engine started on ${engine?.tunName() ?: "fd $fd"}")
            main.post(statsTick)
        } catch (e: KerntunException) {
            Log.e(TAG, "engine did not start: ${e.message}", e)
            main.post { stopSelf() }
        } finally {
            // The engine works on its own duplicate of the descriptor.
            ParcelFileDescriptor.adoptFd(fd).close()
        }
    }

    private fun stopEngine() {
        main.removeCallbacks(statsTick)
        engine?.let {
            it.stop()
            it.close()
        }
        engine = null
    }

    /** Refresh the notification with live statistics once a second. */
    private val statsTick = object : Runnable {
        override fun run() {
            val e = engine ?: return
            if (!e.isRunning()) {
                Log.e(TAG, "engine stopped: ${e.error()}")
                worker.execute {
                    stopEngine()
                    main.post { stopSelf() }
                }
                return
            }
            val s = e.stats()
            val text = "↑ ${human(s.tcpBytesUp + s.udpBytesUp)}  ↓ ${human(s.tcpBytesDown + s.udpBytesDown)}  " +
                "· ${s.tcpSessionsActive} TCP · ${s.udpFlowsActive} UDP"
            getSystemService(NotificationManager::class.java).notify(NOTIFICATION_ID, notification(text))
            main.postDelayed(this, 1000)
        }
    }

    @Suppress("DEPRECATION") // The RUNNING_* levels are still delivered to running services.
    override fun onTrimMemory(level: Int) {
        super.onTrimMemory(level)
        val pressure = when {
            level == ComponentCallbacks2.TRIM_MEMORY_RUNNING_CRITICAL ||
                level >= ComponentCallbacks2.TRIM_MEMORY_COMPLETE -> MemoryPressure.CRITICAL
            level == ComponentCallbacks2.TRIM_MEMORY_RUNNING_LOW ||
                level >= ComponentCallbacks2.TRIM_MEMORY_MODERATE -> MemoryPressure.ELEVATED
            else -> MemoryPressure.NORMAL
        }
        engine?.setMemoryPressure(pressure)
    }

    override fun onRevoke() {
        // Another VPN took over, or the user revoked the permission.
        worker.execute {
            stopEngine()
            main.post { stopSelf() }
        }
    }

    override fun onDestroy() {
        worker.execute { stopEngine() }
        worker.shutdown()
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

        /** "198.18.0.1/16" -> ("198.18.0.1", 16). */
        fun split(cidr: String): Pair<String, Int> {
            val slash = cidr.indexOf('/')
            require(slash > 0) { "expected address/prefix, got $cidr" }
            return cidr.substring(0, slash) to cidr.substring(slash + 1).toInt()
        }

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
