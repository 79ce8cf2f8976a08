// What the Kotlin test scripts (engine_test.kts, android_policy_test.kts)
// share: counted checks, a guard for unexpected exceptions and the summary.
// run.sh compiles it into the same jar as the bindings.
package org.kerntun.testkit

import kotlin.system.exitProcess

private var passed = 0
private var failed = 0

/** Counts one check and prints it as `ok` or `FAIL`. */
fun check(cond: Boolean, what: String) {
    if (cond) {
        passed++
        println("ok   $what")
    } else {
        failed++
        println("FAIL $what")
    }
}

/**
 * Runs [block]; an exception it throws counts as a failure, printed as
 * `FAIL unexpected<where> <class>: <message>` with its stack trace.
 */
fun guarded(where: String = "", block: () -> Unit) {
    try {
        block()
    } catch (e: Throwable) {
        failed++
        println("FAIL unexpected$where ${e::class.qualifiedName}: ${e.message}")
        e.printStackTrace()
    }
}

/**
 * Runs [block]: the [E] it throws, or null when it returns. Any other
 * exception propagates (to [guarded]).
 */
inline fun <reified E : Throwable> thrown(block: () -> Unit): E? {
    try {
        block()
    } catch (e: Throwable) {
        if (e is E) return e
        throw e
    }
    return null
}

/** Prints "N passed, M failed" and exits non-zero on any failure. */
fun finish(): Nothing {
    println("$passed passed, $failed failed")
    exitProcess(if (failed == 0) 0 else 1)
}
