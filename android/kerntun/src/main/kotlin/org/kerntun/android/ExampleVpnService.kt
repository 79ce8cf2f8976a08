// Example subclass. Declare it in the app manifest:
//
//   <service
//       android:name="org.kerntun.android.ExampleVpnService"
//       android:permission="android.permission.BIND_VPN_SERVICE"
//       android:foregroundServiceType="systemExempted"
//       android:exported="false">
//       <intent-filter>
//           <action android:name="android.net.VpnService" />
//       </intent-filter>
//   </service>
//
// and start it after VpnService.prepare(context) was accepted:
//
//   ContextCompat.startForegroundService(context, Intent(context, ExampleVpnService::class.java))

package org.kerntun.android

import org.kerntun.BudgetOptions
import org.kerntun.EngineConfig
import org.kerntun.RuleAction
import org.kerntun.RuleOptions

//
// and watch its state from any activity of the app:
//
//   TunnelStatus.addListener { state -> if (state is TunnelState.Failed) showError(state.kind, state.message) }

class ExampleVpnService : KerntunVpnService() {
    // Every app but these two goes through the tunnel; this app stays inside
    // its own VPN (its engine sockets leave through protect).
    override val appRouting = AppRouting(disallowed = listOf("com.android.vending", "com.google.android.gms"))

    override fun engineConfig(): EngineConfig = super.engineConfig().copy(
        // Refuse a destination outright: apps get an RST at SYN time.
        rules = listOf(RuleOptions(cidr = "203.0.113.0/24", action = RuleAction.Reject)),
        budget = BudgetOptions(tcpSessions = 512uL),
    )
}
