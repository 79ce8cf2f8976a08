// The app's side of Engine.handleMessage (docs/messages.md): v1 requests
// written and replies read as plain Kotlin values, with no JSON library
// (org.json is Android's, and this file is also compiled and tested on a
// plain JVM by ffi/tests/kotlin/run.sh). KerntunVpnService answers them
// through a Messenger (ACTION_MESSAGES); an app in the service's process
// may call EngineHandle.handleMessage directly.

package org.kerntun.android

/** The reply to one request: [Ok] with the command's object, or [Error]. */
sealed class Reply {
    /** The request's `id`, echoed (a Long, a String, or null). */
    abstract val id: Any?

    data class Ok(override val id: Any?, val value: Map<String, Any?>) : Reply()

    /**
     * [kind]: the stable name to match on (`not_running`, `unknown_group`,
     * `needs_restart`, ...: docs/messages.md, "Errors"); [field]: the
     * argument or configuration field at fault, when there is one.
     */
    data class Error(
        override val id: Any?,
        val kind: String,
        val message: String,
        val field: String?,
    ) : Reply()
}

object Messages {
    /** The schema version written into requests. */
    const val VERSION = 1L

    /** Bind KerntunVpnService with this action to get its Messenger. */
    const val ACTION_MESSAGES = "org.kerntun.android.MESSAGES"

    /** `Message.what` of a request and of its reply. */
    const val MSG_REQUEST = 1
    const val MSG_REPLY = 2

    /** The Bundle keys: the request's bytes, the reply's bytes. */
    const val KEY_REQUEST = "request"
    const val KEY_REPLY = "reply"

    /**
     * A request: `{"v":1,"id":id,"cmd":cmd,"args":args}` as UTF-8 bytes.
     * Argument values: null, Boolean, numbers (also the bindings' ULong,
     * UInt), String, an enum of the bindings (written lowercase: LogLevel.DEBUG
     * is "debug"), List, Map (String keys), nested freely (a `reload`
     * configuration).
     */
    fun request(cmd: String, args: Map<String, Any?> = emptyMap(), id: Long = 0): ByteArray =
        write(mapOf("v" to VERSION, "id" to id, "cmd" to cmd, "args" to args)).encodeToByteArray()

    /** Read a reply; a reply that is not one (never from the engine) is an `Error` of kind `bad_reply`. */
    fun reply(bytes: ByteArray): Reply {
        val v = try {
            parse(bytes.decodeToString())
        } catch (e: IllegalArgumentException) {
            return Reply.Error(null, "bad_reply", e.message ?: "not JSON", null)
        }
        val m = v as? Map<*, *> ?: return Reply.Error(null, "bad_reply", "not an object", null)
        val id = m["id"]
        val error = m["error"] as? Map<*, *>
        if (error != null) {
            return Reply.Error(
                id,
                error["kind"] as? String ?: "bad_reply",
                error["message"] as? String ?: "",
                error["field"] as? String,
            )
        }
        @Suppress("UNCHECKED_CAST")
        val ok = m["ok"] as? Map<String, Any?> ?: return Reply.Error(id, "bad_reply", "neither ok nor error", null)
        return Reply.Ok(id, ok)
    }

    /** JSON text of [value] (see [request] for the types). */
    fun write(value: Any?): String = StringBuilder().also { write(value, it) }.toString()

    private fun write(value: Any?, out: StringBuilder) {
        when (value) {
            null -> out.append("null")
            is Boolean -> out.append(value)
            is Double -> out.append(if (value.isFinite()) value.toString() else "null")
            is Float -> write(value.toDouble(), out)
            is Number -> out.append(value.toLong())
            // The bindings' unsigned values (a ConnectionRecord's id is a ULong).
            is ULong, is UInt, is UShort, is UByte -> out.append(value.toString())
            is String -> quote(value, out)
            is Map<*, *> -> {
                out.append('{')
                value.entries.forEachIndexed { i, (k, v) ->
                    if (i > 0) out.append(',')
                    quote(k.toString(), out)
                    out.append(':')
                    write(v, out)
                }
                out.append('}')
            }
            is Iterable<*> -> {
                out.append('[')
                value.forEachIndexed { i, v ->
                    if (i > 0) out.append(',')
                    write(v, out)
                }
                out.append(']')
            }
            is Enum<*> -> quote(value.name.lowercase(), out)
            else -> quote(value.toString(), out)
        }
    }

    private fun quote(s: String, out: StringBuilder) {
        out.append('"')
        for (c in s) {
            when {
                c == '"' -> out.append("\\\"")
                c == '\\' -> out.append("\\\\")
                c == '\n' -> out.append("\\n")
                c == '\r' -> out.append("\\r")
                c == '\t' -> out.append("\\t")
                c < ' ' -> out.append("\\u%04x".format(c.code))
                else -> out.append(c)
            }
        }
        out.append('"')
    }

    /**
     * Parse JSON text: objects as Map<String, Any?>, arrays as List, whole
     * numbers as Long, others as Double. Throws IllegalArgumentException
     * on malformed text.
     */
    fun parse(text: String): Any? {
        val p = Parser(text)
        val v = p.value(0)
        p.space()
        require(p.i == text.length) { "trailing characters at ${p.i}" }
        return v
    }

    private class Parser(val s: String) {
        var i = 0

        fun space() {
            while (i < s.length && s[i] in " \t\r\n") i++
        }

        fun value(depth: Int): Any? {
            require(depth < 64) { "nested too deep" }
            space()
            require(i < s.length) { "unexpected end" }
            return when (s[i]) {
                '{' -> obj(depth)
                '[' -> arr(depth)
                '"' -> str()
                't' -> word("true", true)
                'f' -> word("false", false)
                'n' -> word("null", null)
                else -> num()
            }
        }

        fun word(w: String, v: Any?): Any? {
            require(s.startsWith(w, i)) { "unexpected character at $i" }
            i += w.length
            return v
        }

        fun obj(depth: Int): Map<String, Any?> {
            i++
            val m = LinkedHashMap<String, Any?>()
            space()
            if (i < s.length && s[i] == '}') return m.also { i++ }
            do {
                space()
                require(i < s.length && s[i] == '"') { "expected a key at $i" }
                val k = str()
                space()
                require(i < s.length && s[i] == ':') { "expected ':' at $i" }
                i++
                m[k] = value(depth + 1)
            } while (more('}'))
            return m
        }

        fun arr(depth: Int): List<Any?> {
            i++
            val l = ArrayList<Any?>()
            space()
            if (i < s.length && s[i] == ']') return l.also { i++ }
            do {
                l.add(value(depth + 1))
            } while (more(']'))
            return l
        }

        /** After a member or an element: true at ',', false at [close]. */
        fun more(close: Char): Boolean {
            space()
            require(i < s.length) { "unexpected end" }
            return when (s[i++]) {
                ',' -> true
                close -> false
                else -> throw IllegalArgumentException("expected ',' or '$close' at ${i - 1}")
            }
        }

        fun str(): String {
            i++
            val b = StringBuilder()
            while (true) {
                require(i < s.length) { "unterminated string" }
                val c = s[i++]
                when (c) {
                    '"' -> return b.toString()
                    '\\' -> {
                        require(i < s.length) { "unterminated string" }
                        when (val e = s[i++]) {
                            'n' -> b.append('\n')
                            't' -> b.append('\t')
                            'r' -> b.append('\r')
                            'b' -> b.append('\b')
                            'f' -> b.append('\u000c')
                            'u' -> {
                                require(i + 4 <= s.length) { "short \\u escape" }
                                val code = s.substring(i, i + 4).toIntOrNull(16)
                                    ?: throw IllegalArgumentException("bad \\u escape at $i")
                                b.append(code.toChar())
                                i += 4
                            }
                            else -> b.append(e)
                        }
                    }
                    else -> b.append(c)
                }
            }
        }

        fun num(): Any {
            val start = i
            while (i < s.length && s[i] in "+-0123456789.eE") i++
            val t = s.substring(start, i)
            return t.toLongOrNull() ?: t.toDoubleOrNull()
                ?: throw IllegalArgumentException("unexpected character at $start")
        }
    }
}
