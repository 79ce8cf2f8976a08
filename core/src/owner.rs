//! The app that owns a flow: its uid and package, as the host platform
//! names them (Android: `ConnectivityManager.getConnectionOwnerUid` and
//! `PackageManager.getPackagesForUid`). The connection list shows them
//! (`conns.rs`) and `package` / `uid` rules route by them (`rules.rs`).
//!
//! The host's lookup ([`OwnerLookup`]) is foreign code that may block (a
//! binder call to the system on Android) or never return, so it never runs
//! on the engine's runtime: one thread of its own ([`Owners`]) answers the
//! requests in order, from a queue of [`QUEUE`] entries. A session or a
//! UDP flow's task waits for its answer at most [`TIMEOUT`]; a full queue,
//! an error, a panic or a late answer is a flow without an owner, counted
//! (`owner_failed`), and the flow goes on. A hook that hangs therefore
//! costs that one thread and fails every later lookup fast; it never stalls
//! a flow for longer than [`TIMEOUT`].
//!
//! Where the lookups are asked for (never on the TUN driver's path): a TCP
//! session after accept, before routing when a `package` / `uid` rule could
//! match its address and after routing otherwise (for the record only); a
//! UDP flow when it opens, in a task, with its first datagrams held until
//! the answer when a rule needs it (`udp/sniff.rs`).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::rules::Network;
use crate::stats::Stats;

/// The longest a flow waits for its owner. Android answers
/// `getConnectionOwnerUid` from the kernel's socket table through one
/// binder call; a quarter second is far above that, and what a held
/// datagram or an accepted connection may be delayed at worst.
pub const TIMEOUT: Duration = Duration::from_millis(250);

/// Lookups waiting for the thread. Past it a lookup fails at once
/// (counted): a hook that hangs cannot queue requests without bound.
pub const QUEUE: usize = 64;

/// The app that owns a flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    /// The app's user id (Android: one per installed app, per user).
    pub uid: u32,
    /// Its package name (`com.example.app`); `None` when the platform
    /// names none (a system uid without a package).
    pub package: Option<String>,
}

/// The host's lookup of a flow's owner. `source` is the app's address and
/// port, `destination` the address it sent to. `Ok(None)`: no owner known
/// (the platform found no such socket, or cannot look it up). Called from
/// one thread of the engine's own, one flow at a time.
pub trait OwnerLookup: Send + Sync + fmt::Debug {
    fn owner(
        &self,
        network: Network,
        source: SocketAddr,
        destination: SocketAddr,
    ) -> Result<Option<Owner>, String>;
}

/// The thread's answer: the owner or none, or a failure (the hook's error
/// or panic). Only the flow that waits counts it, so a late answer is
/// counted once, as the timeout it was.
type Answer = Result<Option<Arc<Owner>>, ()>;

/// One lookup for the thread, with where its answer goes.
struct Request {
    network: Network,
    source: SocketAddr,
    destination: SocketAddr,
    answer: oneshot::Sender<Answer>,
}

/// The engine's side of the host's lookup: its thread and the queue to it.
#[derive(Debug)]
pub(crate) struct Owners {
    queue: SyncSender<Request>,
    stats: Arc<Stats>,
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Owners {
    /// Start the lookup thread. It ends when the engine drops this (the
    /// queue closes), after the lookup it is in, if any.
    pub fn start(lookup: Arc<dyn OwnerLookup>, stats: Arc<Stats>) -> std::io::Result<Owners> {
        let (queue, requests) = sync_channel::<Request>(QUEUE);
        std::thread::Builder::new()
            .name("kerntun-owner".into())
            .spawn(move || {
                for r in requests {
                    // Its flow stopped waiting (timed out, or ended).
                    if r.answer.is_closed() {
                        continue;
                    }
                    let found = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        lookup.owner(r.network, r.source, r.destination)
                    }));
                    let answer = match found {
                        Ok(Ok(owner)) => Ok(owner.map(Arc::new)),
                        Ok(Err(e)) => {
                            tracing::debug!("owner of {}: {e}", r.source);
                            Err(())
                        }
                        Err(_) => {
                            tracing::debug!("owner of {}: the lookup panicked", r.source);
                            Err(())
                        }
                    };
                    let _ = r.answer.send(answer);
                }
            })?;
        Ok(Owners { queue, stats })
    }

    /// The owner of the flow from `source` to `destination`, within
    /// [`TIMEOUT`]; `None` when unknown or the lookup failed (counted).
    pub async fn lookup(
        &self,
        network: Network,
        source: SocketAddr,
        destination: SocketAddr,
    ) -> Option<Arc<Owner>> {
        self.stats.owner_lookups.fetch_add(1, Relaxed);
        let (answer, rx) = oneshot::channel();
        let request = Request {
            network,
            source,
            destination,
            answer,
        };
        match self.queue.try_send(request) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.owner_failed.fetch_add(1, Relaxed);
                return None;
            }
        }
        match tokio::time::timeout(TIMEOUT, rx).await {
            Ok(Ok(Ok(Some(owner)))) => Some(owner),
            Ok(Ok(Ok(None))) => {
                self.stats.owner_unknown.fetch_add(1, Relaxed);
                None
            }
            // The hook failed, or the thread is gone (it lives as long as
            // `self`), or no answer in time.
            Ok(Ok(Err(()))) | Ok(Err(_)) | Err(_) => {
                self.stats.owner_failed.fetch_add(1, Relaxed);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;

    /// Names uid 10001 for client port 1000, nobody for 2000, fails for
    /// 3000, panics for 4000, and hangs (until released) for 5000.
    #[derive(Debug, Default)]
    struct Fake {
        release: AtomicBool,
    }

    impl OwnerLookup for Fake {
        fn owner(
            &self,
            _: Network,
            source: SocketAddr,
            _: SocketAddr,
        ) -> Result<Option<Owner>, String> {
            match source.port() {
                1000 => Ok(Some(Owner {
                    uid: 10001,
                    package: Some("com.example.one".into()),
                })),
                2000 => Ok(None),
                3000 => Err("no such socket".into()),
                4000 => panic!("foreign code panicked"),
                _ => {
                    while !self.release.load(Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Ok(None)
                }
            }
        }
    }

    fn from(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 2], port))
    }

    /// Each answer is what the hook said; errors, panics and a hook that
    /// hangs fail the lookup (counted) within the timeout, and once the
    /// queue is full a lookup fails at once instead of waiting.
    #[tokio::test]
    async fn answers_failures_and_a_hanging_hook_are_bounded() {
        let stats = Arc::new(Stats::default());
        let fake = Arc::new(Fake::default());
        let owners = Owners::start(fake.clone(), stats.clone()).expect("thread");
        let dst = SocketAddr::from(([192, 0, 2, 1], 443));
        let one = owners.lookup(Network::Tcp, from(1000), dst).await;
        assert_eq!(one.as_ref().map(|o| o.uid), Some(10001));
        assert_eq!(
            one.and_then(|o| o.package.clone()).as_deref(),
            Some("com.example.one")
        );
        assert!(owners.lookup(Network::Udp, from(2000), dst).await.is_none());
        assert!(owners.lookup(Network::Tcp, from(3000), dst).await.is_none());
        assert!(owners.lookup(Network::Tcp, from(4000), dst).await.is_none());
        assert_eq!(stats.owner_unknown.load(Relaxed), 1);
        // The error and the panic; counted once each, also when the panic
        // (its backtrace printed by the test harness) outlasts the timeout.
        assert_eq!(stats.owner_failed.load(Relaxed), 2, "error and panic");
        // The thread survived the panic (it may still be printing it).
        let mut survived = false;
        for _ in 0..40 {
            if owners.lookup(Network::Tcp, from(1000), dst).await.is_some() {
                survived = true;
                break;
            }
        }
        assert!(survived, "the thread answers after a panic");

        let failed = stats.owner_failed.load(Relaxed);
        let asked = stats.owner_lookups.load(Relaxed);
        let started = std::time::Instant::now();
        assert!(owners.lookup(Network::Tcp, from(5000), dst).await.is_none());
        let took = started.elapsed();
        assert!(took >= TIMEOUT && took < TIMEOUT * 8, "{took:?}");
        assert_eq!(stats.owner_failed.load(Relaxed), failed + 1, "timed out");
        // The thread is stuck: the queue fills, then lookups fail at once.
        let owners = Arc::new(owners);
        let started = std::time::Instant::now();
        let waits: Vec<_> = (0..QUEUE + 4)
            .map(|_| {
                let owners = owners.clone();
                tokio::spawn(async move { owners.lookup(Network::Tcp, from(1000), dst).await })
            })
            .collect();
        for w in waits {
            assert!(w.await.expect("lookup task").is_none());
        }
        assert!(started.elapsed() < TIMEOUT * 8);
        assert_eq!(
            stats.owner_failed.load(Relaxed),
            failed + 1 + QUEUE as u64 + 4,
            "every one counted"
        );
        fake.release.store(true, Relaxed);
        assert_eq!(
            stats.owner_lookups.load(Relaxed),
            asked + 1 + QUEUE as u64 + 4
        );
    }
}
