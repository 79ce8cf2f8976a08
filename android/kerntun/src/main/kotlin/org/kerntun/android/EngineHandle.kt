// The engine as the VpnService glue holds it: no android.* import, so the
// Kotlin FFI test (ffi/tests/kotlin/run.sh) compiles and hammers it on a
// plain JVM.

package org.kerntun.android

import java.util.concurrent.atomic.AtomicBoolean
import org.kerntun.Engine
import org.kerntun.EngineListener
import org.kerntun.EngineStats
import org.kerntun.KerntunException
import org.kerntun.LogLevel
import org.kerntun.LogRecord
import org.kerntun.MemoryPressure
import org.kerntun.NetworkInfo
import org.kerntun.handleMessageWithoutEngine

/**
 * A running [Engine] that any thread may call at any time, also while
 * another thread stops or closes it, and after: the app's stats timer and
 * its health check then read "not running" and no statistics, instead of
 * the generated bindings' use-after-close `IllegalStateException` (which a
 * call that begins after [Engine.close] meets). The engine's own calls
 * never wait for `stop` (`stats`, `isRunning` and `error` answer in
 * microseconds throughout), so this adds no lock: a flag, and the one
 * exception read as "closed" once the flag is set.
 */
class EngineHandle(private val engine: Engine) : AutoCloseable {
    private val closed = AtomicBoolean(false)

    private inline fun <T> call(whenClosed: T, f: (Engine) -> T): T {
        if (closed.get()) return whenClosed
        return try {
            f(engine)
        } catch (e: IllegalStateException) {
            // The bindings refuse a call that started after close(); any
            // other IllegalStateException is not ours to hide.
            if (closed.get()) whenClosed else throw e
        }
    }

    /** False once stopped, failed or closed. */
    fun isRunning(): Boolean = call(false) { it.isRunning() }

    /** Why the engine stopped on its own, if it did (null once closed). */
    fun error(): String? = call(null) { it.error() }

    /** The engine's counters; null once closed. */
    fun stats(): EngineStats? = call(null) { it.stats() }

    fun setMemoryPressure(level: MemoryPressure) = call(Unit) { it.setMemoryPressure(level) }

    /**
     * Tell the engine that the underlying network moved
     * ([Engine.networkChanged]): true when that changed something; false
     * when nothing changed, and once stopped, failed or closed (there is
     * nothing to move then). A bad report (a DNS server that is not an
     * address) still throws [KerntunException.Network].
     */
    fun networkChanged(info: NetworkInfo): Boolean = call(false) {
        try {
            it.networkChanged(info)
        } catch (e: KerntunException.NotRunning) {
            false
        }
    }

    /** Hear the engine's state events (null: nobody); a no-op once closed. */
    fun setListener(listener: EngineListener?) = call(Unit) { it.setListener(listener) }

    /** The engine's last log lines, oldest first; empty once closed. */
    fun recentLogs(): List<LogRecord> = call(emptyList()) { it.recentLogs() }

    fun setLogLevel(level: LogLevel) = call(Unit) { it.setLogLevel(level) }

    /**
     * The reply to one message from the app (docs/messages.md, Messages.kt);
     * once closed, the reply of a process without an engine (`status`:
     * not running; the rest: `not_running`). Blocks as the command does
     * (`test_latency` up to its timeout): not on the main thread.
     */
    fun handleMessage(request: ByteArray): ByteArray {
        if (closed.get()) return handleMessageWithoutEngine(request)
        return try {
            engine.handleMessage(request)
        } catch (e: IllegalStateException) {
            if (closed.get()) handleMessageWithoutEngine(request) else throw e
        }
    }

    /** Stops the engine (bounded by the engine's drain deadline); idempotent. */
    fun stop() = call(Unit) { it.stop() }

    /** Frees the engine (stopping it first on a thread of its own if it still runs); idempotent. */
    override fun close() {
        if (closed.compareAndSet(false, true)) engine.close()
    }
}
