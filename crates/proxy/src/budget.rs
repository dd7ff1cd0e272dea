//! The budget of bytes held in bodies at once (`max_buffered_bytes`): client bodies being
//! received, upstream bodies being read, held or merged, and bytes on their way to clients
//! until they are written. Large bodies leave the last 1/32nd of it to small ones, so a
//! budget full of long-context replies still lets small requests through. A client body that would go past
//! it is refused (503 + Retry-After). An upstream reply waits for room instead (it stays in the
//! socket meanwhile: TCP pushes back on the server), for a bounded time; prefill replies may
//! fill only three quarters of the budget, so decode replies, which finish requests and free
//! their bytes, always have room to make progress.
//!
//! **No lock-up.** A share that holds bytes and waits for more (a stream's partial event, a
//! reply half read) keeps others from the bytes it holds; if every holder waited on another,
//! none would ever finish. So only one share that holds bytes may wait at a time (the turn); a
//! holder that finds the turn taken waits a moment ([`HOLDER_GRACE`]) for room or the turn,
//! then gives up (its request fails cleanly and its bytes come back), and a share that holds
//! nothing may always wait. Then no state has every holder
//! waiting: the one with the turn waits on bytes that holders without it either keep growing
//! and finish with, or give back. A request's bytes count together: a share opened beside bytes
//! its request already holds (decode's reply beside the prefill body) is a holder even while
//! empty.
//!
//! **In order.** Large shares that hold nothing (a prefill reply whose size its header gave)
//! wait in a queue and take room first come, first served: when the budget cannot hold every
//! request's prefill reply at once, requests take turns instead of racing for freed bytes (a
//! newcomer never passes one that waits). Holders do not queue: they finish requests, which
//! frees room. A body larger than the budget could ever give it is refused at once
//! ([`Share::room`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// Bodies up to this size are small: they may fill the part of the budget that large ones
/// leave free (a 1/32nd), so small requests are served while large ones wait for room.
pub const SMALL_BODY: usize = 256 * 1024;
const SMALL_BODIES_PART: usize = 32;

/// How long a share that holds bytes waits for room while another holder has the turn: room
/// that clients free by reading usually comes within it; past it, the share gives up, so
/// holders never wait on each other for longer.
pub const HOLDER_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The process-wide count of bytes held, against its limit.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    /// The most held at once since [`take_peak`](Budget::take_peak) last read it.
    peak: AtomicUsize,
    limit: usize,
    freed: Notify,
    /// The turn to wait while holding bytes (see the module's doc).
    turn: tokio::sync::Mutex<()>,
    /// Large shares holding nothing that wait for room, in the order they came.
    queue: Mutex<VecDeque<u64>>,
    tickets: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            limit,
            freed: Notify::new(),
            turn: tokio::sync::Mutex::new(()),
            queue: Mutex::new(VecDeque::new()),
            tickets: AtomicU64::new(0),
        })
    }

    /// Shares waiting in the queue now.
    pub fn queued(&self) -> usize {
        self.queue.lock().map_or(0, |q| q.len())
    }

    fn join_queue(self: &Arc<Self>) -> Ticket {
        let id = self.tickets.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut q) = self.queue.lock() {
            q.push_back(id);
        }
        Ticket {
            budget: Arc::clone(self),
            id,
        }
    }

    fn queue_is_empty(&self) -> bool {
        self.queue.lock().map_or(true, |q| q.is_empty())
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// What replies that do not finish a request (prefill's) may fill: three quarters.
    pub fn prefill_ceiling(&self) -> usize {
        self.limit - self.limit / 4
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The most bytes held at once since [`take_peak`](Budget::take_peak) (or the start).
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// [`peak`](Budget::peak), counted anew from what is held now (once memory is given back).
    pub fn take_peak(&self) -> usize {
        self.peak.swap(self.used(), Ordering::Relaxed)
    }

    /// An empty share of the budget, which grows as a body arrives and gives its bytes back
    /// when dropped.
    pub fn share(self: &Arc<Self>) -> Share {
        Share {
            budget: Arc::clone(self),
            held: 0,
            beside: 0,
            reserve: 0,
        }
    }
}

/// A place in the budget's queue; leaving it (taking room, giving up, or the request
/// dropped) lets the next one look.
struct Ticket {
    budget: Arc<Budget>,
    id: u64,
}

impl Ticket {
    fn first(&self) -> bool {
        self.budget
            .queue
            .lock()
            .map_or(true, |q| q.front() == Some(&self.id))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Ok(mut q) = self.budget.queue.lock() {
            if let Some(at) = q.iter().position(|&id| id == self.id) {
                q.remove(at);
            }
        }
        self.budget.freed.notify_waiters();
    }
}

/// The bytes of one body counted against the budget; given back on drop.
#[derive(Debug)]
pub struct Share {
    budget: Arc<Budget>,
    held: usize,
    /// Bytes its request holds in other shares (see the module's doc).
    beside: usize,
    /// Bytes counted in the budget for this share to grow into without waiting (see
    /// [`set_aside`](Share::set_aside)).
    reserve: usize,
}

impl Share {
    /// This share, opened beside `n` bytes its request holds in other shares: while it waits
    /// for room, it keeps those from others (the module's no-lock-up rule).
    pub fn beside(mut self, n: usize) -> Self {
        self.beside = n;
        self
    }

    /// Take `n` more bytes; `false` (nothing taken) when that would pass the limit.
    pub fn grow(&mut self, n: usize) -> bool {
        let limit = self.budget.limit;
        self.grow_within(n, limit)
    }

    /// Take `n` more bytes once the budget has room below `ceiling`, waiting until then
    /// (until `deadline` at most); `false` (nothing taken) if it never came. A share that holds
    /// bytes waits with the turn; while another holder has it, it waits for room or the turn
    /// for [`HOLDER_GRACE`] at most, then gives up (the module's no-lock-up rule).
    pub async fn grow_wait(
        &mut self,
        n: usize,
        ceiling: usize,
        deadline: tokio::time::Instant,
    ) -> bool {
        let holder = self.held + self.beside + self.reserve > 0;
        // Large shares that hold nothing take room in the queue's order: at once only when no
        // one waits before them.
        let queued = !holder && !self.is_small(n);
        if (!queued || self.budget.queue_is_empty()) && self.grow_within(n, ceiling) {
            return true;
        }
        if n > ceiling || n > self.room(n, ceiling) {
            return false; // it can never fit
        }
        let budget = Arc::clone(&self.budget);
        if queued {
            // In order: it takes room only at the front of the queue.
            let ticket = budget.join_queue();
            loop {
                let freed = budget.freed.notified();
                tokio::pin!(freed);
                freed.as_mut().enable();
                if ticket.first() && self.grow_within(n, ceiling) {
                    return true; // the ticket, dropped, lets the next one look
                }
                tokio::select! {
                    _ = freed => {}
                    _ = tokio::time::sleep_until(deadline) => return false,
                }
            }
        }
        // A share that holds bytes waits for room with the turn; without it, for room or the
        // turn, until the grace runs out.
        let grace = (tokio::time::Instant::now() + HOLDER_GRACE).min(deadline);
        let mut turn = None;
        loop {
            let freed = budget.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable(); // registered before the check: no wake-up is missed
            if self.grow_within(n, ceiling) {
                return true;
            }
            let waiting_for_turn = holder && turn.is_none();
            let until = if waiting_for_turn { grace } else { deadline };
            tokio::select! {
                t = budget.turn.lock(), if waiting_for_turn => turn = Some(t),
                _ = freed => {}
                _ = tokio::time::sleep_until(until) => return false,
            }
        }
    }

    /// Bytes this share holds.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Keep `n` of the bytes this share took counted, as room its request will grow into
    /// later (a prefill reply's, for decode's reply) without waiting: taken with the reply,
    /// in the queue's order, so a request admitted never waits on another for its next body.
    pub fn set_aside(&mut self, n: usize) {
        let n = n.min(self.held);
        self.held -= n;
        self.reserve += n;
    }

    /// This share's reserve, moved into a share of its own that grows into it first.
    pub fn take_reserve(&mut self) -> Share {
        Share {
            budget: Arc::clone(&self.budget),
            held: 0,
            beside: 0,
            reserve: std::mem::take(&mut self.reserve),
        }
    }

    /// Bytes counted for this share to grow into (see [`set_aside`](Share::set_aside)).
    #[cfg(test)]
    fn reserve(&self) -> usize {
        self.reserve
    }

    /// What this share holds beyond `n` bytes, moved into a share of its own (bytes that leave
    /// with a piece sent on stay counted until the piece is written and dropped).
    pub fn split_beyond(&mut self, n: usize) -> Share {
        let moved = self.held.saturating_sub(n);
        self.held -= moved;
        Share {
            budget: Arc::clone(&self.budget),
            held: moved,
            beside: 0,
            reserve: 0,
        }
    }

    /// Give back what this share holds beyond `n` bytes.
    pub fn shrink_to(&mut self, n: usize) {
        if self.held > n {
            let freed = self.held - n;
            self.held = n;
            self.budget.used.fetch_sub(freed, Ordering::Relaxed);
            self.budget.freed.notify_waiters();
        }
    }

    /// Whether the request, with `n` more bytes, is small (see the module's doc: a request is
    /// as large as all it holds, so a stream's first chunks beside a large prefill body are not
    /// small).
    pub fn is_small(&self, n: usize) -> bool {
        (self
            .held
            .saturating_add(self.beside)
            .saturating_add(self.reserve))
        .checked_add(n)
        .is_some_and(|t| t <= SMALL_BODY)
    }

    /// The most this share could ever take more, asked for `n` bytes under `ceiling` (the
    /// budget empty but for its request): a small request may fill the whole budget, a large
    /// one the ceiling less the part kept for small ones.
    pub fn room(&self, n: usize, ceiling: usize) -> usize {
        let most = if self.is_small(n) {
            self.budget.limit
        } else {
            ceiling.saturating_sub(self.budget.limit / SMALL_BODIES_PART)
        };
        let taken = self.held.saturating_add(self.beside);
        most.saturating_sub(taken).saturating_add(self.reserve)
    }

    fn grow_within(&mut self, n: usize, ceiling: usize) -> bool {
        // The reserve first: those bytes are counted already.
        let reserved = n.min(self.reserve);
        if reserved > 0 {
            self.reserve -= reserved;
            self.held += reserved;
            if reserved == n {
                return true;
            }
            if !self.grow_within(n - reserved, ceiling) {
                self.held -= reserved; // nothing taken: the reserve is as it was
                self.reserve += reserved;
                return false;
            }
            return true;
        }
        let b = &self.budget;
        // Small requests may use the last part of the budget; large ones stop short of it.
        let ceiling = if self.is_small(n) {
            b.limit // prefill's too: a small request must not wait for large decodes to finish
        } else {
            ceiling.saturating_sub(b.limit / SMALL_BODIES_PART)
        };
        let mut used = b.used.load(Ordering::Relaxed);
        let next = loop {
            let Some(next) = used.checked_add(n).filter(|&t| t <= ceiling) else {
                return false;
            };
            match b
                .used
                .compare_exchange_weak(used, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => break next,
                Err(now) => used = now,
            }
        };
        self.held += n;
        b.peak.fetch_max(next, Ordering::Relaxed);
        true
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.held += std::mem::take(&mut self.reserve);
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests;
