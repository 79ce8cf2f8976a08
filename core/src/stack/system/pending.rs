//! What the system stack attaches to an admitted half-open flow in its
//! flow table (the `P` of [`NatTable`](crate::nat::NatTable)): the
//! admission permit, and the connect task or what the accepted connection
//! goes on to. The table keeps it beside the flow's entry and hands it back
//! from whichever transition ends the half-open stage; the stack then
//! passes it to the session (accepted) or [`Pending::close`]s it.

use tokio::task::AbortHandle;

use crate::budget::OwnedPermit;
use crate::dispatch::Next;
use crate::outbound::reset_on_close;

/// One admitted connection waiting for the kernel to accept the app's side.
#[derive(Debug)]
pub(super) enum Pending {
    /// The outbound connect is in flight; the app's SYN is held by its
    /// task. The task is attached once spawned ([`Pending::set_task`]);
    /// the permit waits here, not in the task, so an eviction hands it
    /// back at once (an aborted task drops what it holds later).
    Connecting {
        task: Option<AbortHandle>,
        permit: OwnedPermit,
    },
    /// The SYN went to the kernel; the accepted connection goes on to
    /// `next`.
    Ready { next: Next, permit: OwnedPermit },
}

impl Pending {
    /// A connect about to start, holding `permit`.
    pub(super) fn connecting(permit: OwnedPermit) -> Self {
        Pending::Connecting { task: None, permit }
    }

    /// The connect task, once spawned.
    pub(super) fn set_task(&mut self, handle: AbortHandle) {
        if let Pending::Connecting { task, .. } = self {
            *task = Some(handle);
        }
    }

    /// The connect succeeded with `next`: Ready, with the same permit.
    pub(super) fn ready(self, next: Next) -> Self {
        match self {
            Pending::Connecting { permit, .. } => Pending::Ready { next, permit },
            // The table moves only Connecting flows to Ready.
            Pending::Ready { next: old, permit } => {
                close_next(&old);
                Pending::Ready { next, permit }
            }
        }
    }

    /// Stop what the entry holds: abort its connect, reset its outbound.
    /// Its permit goes with it.
    pub(super) fn close(self) {
        match self {
            Pending::Connecting { task, .. } => {
                if let Some(t) = task {
                    t.abort();
                }
            }
            Pending::Ready { next, .. } => close_next(&next),
        }
    }
}

/// Reset a connected outbound that no connection will use.
pub(super) fn close_next(next: &Next) {
    if let Next::Relay(out) = next {
        reset_on_close(&out.stream);
    }
}
