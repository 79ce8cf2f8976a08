//! The TUN reader thread and its bounded ring (Linux/Android, per-packet
//! driver, `tun.read_ring` > 0).
//!
//! A thread of its own only reads: it waits in poll(2) on the device and a
//! wake-up socket, then reads packets (non-blocking, one `read(2)` each)
//! into preallocated slots at [`HEADROOM`] until the device is empty or no
//! slot is free, and hands them to the driver task in batches. The driver
//! task pops them, processes them and writes back as before
//! (`per_packet.rs`). The kernel's queue is thus emptied while the driver
//! writes: on a per-packet TUN each write carries the kernel's TCP receive
//! and nothing is read meanwhile.
//!
//! The slots move between two queues under one lock (`full` toward the
//! driver, `free` back to the reader), taken once per batch on each side,
//! never once per packet, and never across a system call: the reader reads
//! into slots it holds, the driver processes slots it has popped.
//!
//! A full ring is back-pressure, not a drop: the reader stops reading and
//! the packets wait in the kernel's queue (which drops what overflows it,
//! `tx_dropped`) until the driver frees slots. Reading them only to drop
//! them would throw the kernel's queue away; as it is, the two add up.
//! The times the reader found no free slot are counted
//! (`Stats::tun_ring_full`).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::packet::HEADROOM;
use crate::stats::Stats;
use crate::tun::Tun;

/// Packets the reader reads before it hands them to the driver, if the
/// device has more: a batch costs one lock, and the driver waits for at
/// most 16 reads (~1 us each) for the first of them.
const PUBLISH_BATCH: usize = 16;

/// The reader thread's name (within Linux's 15 characters, so
/// `/proc/<pid>/task/*/comm` shows it whole).
pub const READER_THREAD: &str = "kerntun-reader";

/// One packet buffer: the packet is at `buf[HEADROOM..HEADROOM + len]`.
pub(crate) struct Slot {
    buf: Box<[u8]>,
    len: usize,
}

impl Slot {
    /// The whole buffer, headroom included.
    pub fn buf_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// The packet's length.
    pub fn packet_len(&self) -> usize {
        self.len
    }
}

struct Queues {
    /// Packets read, oldest first, not yet taken by the driver.
    full: VecDeque<Slot>,
    /// Slots the driver gave back.
    free: Vec<Slot>,
    /// The reader found no free slot and sleeps until [`Ring::recycle`]
    /// gives some back (set and cleared under this lock, so the wake-up
    /// cannot be lost).
    reader_waits: bool,
    /// Why the reader ended; reported after the packets read before it.
    ended: Option<io::Error>,
}

/// The ring between the reader thread and the driver task.
pub(crate) struct Ring {
    queues: Mutex<Queues>,
    /// The ring went from empty to non-empty, or the reader ended.
    ready: Notify,
    /// Wakes the reader from poll(2): slots freed, or stop.
    wake: UnixStream,
    stop: AtomicBool,
    slots: usize,
}

impl Ring {
    /// A ring of `slots` buffers of `slot_len` bytes each (allocated here,
    /// once), and the reader's end of the wake-up socket.
    fn new(slots: usize, slot_len: usize) -> io::Result<(Arc<Ring>, UnixStream)> {
        let (wake, wake_rx) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        wake_rx.set_nonblocking(true)?;
        let free = (0..slots)
            .map(|_| Slot {
                buf: vec![0u8; slot_len].into_boxed_slice(),
                len: 0,
            })
            .collect();
        let ring = Ring {
            queues: Mutex::new(Queues {
                full: VecDeque::with_capacity(slots),
                free,
                reader_waits: false,
                ended: None,
            }),
            ready: Notify::new(),
            wake,
            stop: AtomicBool::new(false),
            slots,
        };
        Ok((Arc::new(ring), wake_rx))
    }

    /// Wait until the ring holds a packet or the reader ended. May return
    /// with nothing to pop (a wake-up left from a batch already taken).
    pub async fn readable(&self) {
        {
            let q = self.queues.lock();
            if !q.full.is_empty() || q.ended.is_some() {
                return;
            }
        }
        // A notification sent after the check above is kept as a permit.
        self.ready.notified().await;
    }

    /// Move up to `max` packets, oldest first, into `out`. Once the ring is
    /// empty, the reason the reader ended, if it did.
    pub fn pop(&self, out: &mut Vec<Slot>, max: usize) -> io::Result<()> {
        let mut q = self.queues.lock();
        let n = max.min(q.full.len());
        out.extend(q.full.drain(..n));
        if n == 0
            && let Some(e) = q.ended.take()
        {
            return Err(e);
        }
        Ok(())
    }

    /// Give the slots in `done` back to the reader (waking it if it waits
    /// for one).
    pub fn recycle(&self, done: &mut Vec<Slot>) {
        if done.is_empty() {
            return;
        }
        let waits = {
            let mut q = self.queues.lock();
            q.free.append(done);
            std::mem::take(&mut q.reader_waits)
        };
        if waits {
            self.wake_reader();
        }
    }

    /// The reader hands `batch` over; the driver is woken if the ring was
    /// empty (one wake-up per burst).
    fn publish(&self, batch: &mut Vec<Slot>) {
        if batch.is_empty() {
            return;
        }
        let was_empty = {
            let mut q = self.queues.lock();
            let was_empty = q.full.is_empty();
            q.full.extend(batch.drain(..));
            was_empty
        };
        if was_empty {
            self.ready.notify_one();
        }
    }

    /// The reader takes every free slot into `spare`; if there is none it
    /// is marked as waiting (false) and must sleep until woken.
    fn take_free(&self, spare: &mut Vec<Slot>) -> bool {
        let mut q = self.queues.lock();
        spare.append(&mut q.free);
        q.reader_waits = spare.is_empty();
        !spare.is_empty()
    }

    /// The reader ended for `e`: the driver sees it once the packets read
    /// before it are taken.
    fn end(&self, e: io::Error) {
        self.queues.lock().ended.get_or_insert(e);
        self.ready.notify_one();
    }

    fn wake_reader(&self) {
        // A full socket buffer already holds a wake-up: nothing lost.
        let _ = (&self.wake).write(&[1]);
    }
}

/// The reader thread; dropping it stops and joins it.
pub(crate) struct Reader {
    ring: Arc<Ring>,
    thread: Option<JoinHandle<()>>,
}

impl Reader {
    /// Start reading `tun` into a ring of `slots` packets of up to `mtu`
    /// bytes each.
    pub fn start(tun: Arc<Tun>, slots: usize, mtu: usize, stats: Arc<Stats>) -> io::Result<Self> {
        // The same room per packet as the in-task reader's buffer.
        let (ring, wake_rx) = Ring::new(slots.max(1), HEADROOM + mtu.max(1500) + 64)?;
        let r = ring.clone();
        let thread = std::thread::Builder::new()
            .name(READER_THREAD.into())
            .spawn(move || read_loop(&r, &tun, wake_rx, &stats))?;
        Ok(Reader {
            ring,
            thread: Some(thread),
        })
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.ring
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.ring.stop.store(true, Ordering::Release);
        self.ring.wake_reader();
        if let Some(t) = self.thread.take() {
            // The thread returns at its next poll(2), which the wake-up
            // above ends at once.
            let _ = t.join();
        }
    }
}

/// Marks the ring ended if the reader leaves without a reason (a panic),
/// so the driver does not wait for packets that never come.
struct EndGuard<'a>(&'a Ring);

impl Drop for EndGuard<'_> {
    fn drop(&mut self) {
        if !self.0.stop.load(Ordering::Acquire) {
            self.0.end(io::Error::other("the TUN reader thread ended"));
        }
    }
}

/// The reader thread's loop: wait, read until the device is empty or no
/// slot is free, hand over, until stopped or the device fails.
fn read_loop(ring: &Ring, tun: &Tun, mut wake_rx: UnixStream, stats: &Stats) {
    let _guard = EndGuard(ring);
    let dev = tun.dev.as_fd();
    let mut spare: Vec<Slot> = Vec::with_capacity(ring.slots);
    let mut batch: Vec<Slot> = Vec::with_capacity(PUBLISH_BATCH);
    let mut drain = [0u8; 64];
    let mut dev_ready = false;
    loop {
        // Checked here too: a flood the driver keeps up with never polls.
        if ring.stop.load(Ordering::Acquire) {
            return;
        }
        if spare.is_empty() && !ring.take_free(&mut spare) {
            stats.tun_ring_full.fetch_add(1, Ordering::Relaxed);
        }
        if !dev_ready || spare.is_empty() {
            let want_dev = !spare.is_empty();
            let (d, w) = match crate::sys::poll_readable(want_dev.then_some(dev), wake_rx.as_fd()) {
                Ok(r) => r,
                Err(e) => return ring.end(e),
            };
            if w {
                while matches!(wake_rx.read(&mut drain), Ok(n) if n > 0) {}
            }
            if ring.stop.load(Ordering::Acquire) {
                return;
            }
            dev_ready = d;
            if !d {
                continue;
            }
        }
        // Read until the device is empty or every held slot is used.
        while let Some(mut slot) = spare.pop() {
            match crate::sys::read_fd(dev, &mut slot.buf[HEADROOM..]) {
                Ok(len) => {
                    slot.len = len;
                    batch.push(slot);
                    if batch.len() == PUBLISH_BATCH {
                        ring.publish(&mut batch);
                    }
                }
                Err(e) => {
                    spare.push(slot);
                    if super::is_fatal(&e) {
                        ring.publish(&mut batch);
                        return ring.end(e);
                    }
                    if e.kind() != io::ErrorKind::Interrupted {
                        dev_ready = false;
                        break;
                    }
                }
            }
        }
        ring.publish(&mut batch);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(ring: &Ring, spare: &mut Vec<Slot>, n: usize, first: u8) -> Vec<Slot> {
        let mut batch = Vec::new();
        for i in 0..n {
            let mut s = spare.pop().expect("a free slot");
            s.buf[HEADROOM] = first.wrapping_add(i as u8);
            s.len = 1;
            batch.push(s);
        }
        ring.publish(&mut batch);
        batch
    }

    fn firsts(out: &[Slot]) -> Vec<u8> {
        out.iter().map(|s| s.buf[HEADROOM]).collect()
    }

    #[test]
    fn packets_come_out_in_order_and_slots_wrap_around() {
        let (ring, _rx) = Ring::new(4, HEADROOM + 16).expect("ring");
        let mut spare = Vec::new();
        let mut out = Vec::new();
        let mut next = 0u8;
        // 10 rounds of 3 through 4 slots: every slot is reused, out of
        // its original position, and the order holds.
        for _ in 0..10 {
            if spare.len() < 3 {
                assert!(ring.take_free(&mut spare));
            }
            fill(&ring, &mut spare, 3, next);
            ring.pop(&mut out, 2).expect("no error");
            ring.pop(&mut out, 2).expect("no error");
            assert_eq!(firsts(&out), vec![next, next + 1, next + 2]);
            next += 3;
            ring.recycle(&mut out);
            assert!(out.is_empty());
        }
    }

    #[test]
    fn a_full_ring_makes_the_reader_wait_until_room_comes_back() {
        let (ring, mut rx) = Ring::new(3, HEADROOM + 16).expect("ring");
        rx.set_nonblocking(true).expect("nonblocking");
        let mut spare = Vec::new();
        assert!(ring.take_free(&mut spare));
        assert_eq!(spare.len(), 3);
        fill(&ring, &mut spare, 3, 10);
        // No slot left: the reader must wait, and says so.
        assert!(!ring.take_free(&mut spare));
        assert!(ring.queues.lock().reader_waits);
        let mut b = [0u8; 8];
        assert!(rx.read(&mut b).is_err(), "no wake-up before room");
        let mut out = Vec::new();
        ring.pop(&mut out, 1).expect("no error");
        ring.recycle(&mut out);
        assert_eq!(rx.read(&mut b).expect("woken"), 1);
        assert!(!ring.queues.lock().reader_waits);
        assert!(ring.take_free(&mut spare));
        assert_eq!(spare.len(), 1);
        // The two left come out before the one read after the wait.
        fill(&ring, &mut spare, 1, 13);
        ring.pop(&mut out, 8).expect("no error");
        assert_eq!(firsts(&out), vec![11, 12, 13]);
    }

    #[test]
    fn the_driver_is_woken_once_per_burst_and_an_end_after_the_packets() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (ring, _rx) = Ring::new(8, HEADROOM + 16).expect("ring");
            let mut spare = Vec::new();
            assert!(ring.take_free(&mut spare));
            fill(&ring, &mut spare, 2, 0);
            // Not empty: the second batch wakes nobody.
            fill(&ring, &mut spare, 2, 2);
            let mut out = Vec::new();
            ring.readable().await;
            ring.pop(&mut out, 8).expect("no error");
            assert_eq!(out.len(), 4);
            // The one permit the first batch left is spent here.
            ring.readable().await;
            ring.pop(&mut out, 8).expect("no error");
            assert_eq!(out.len(), 4);
            // Empty, no permit: the wait is pending until a batch comes.
            let waited =
                tokio::time::timeout(std::time::Duration::from_millis(20), ring.readable()).await;
            assert!(waited.is_err(), "woken without a packet");
            fill(&ring, &mut spare, 1, 4);
            ring.end(io::Error::from_raw_os_error(libc::EBADFD));
            ring.readable().await;
            out.clear();
            ring.pop(&mut out, 8).expect("the packet first");
            assert_eq!(firsts(&out), vec![4]);
            out.clear();
            let e = ring.pop(&mut out, 8).expect_err("then the end");
            assert_eq!(e.raw_os_error(), Some(libc::EBADFD));
        });
    }
}
