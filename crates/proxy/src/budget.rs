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
mod tests {
    use super::*;

    #[test]
    fn shares_stop_at_the_limit_and_give_back_on_drop() {
        let b = Budget::new(10);
        let mut a = b.share();
        assert!(a.grow(6));
        let mut c = b.share();
        assert!(!c.grow(5));
        assert!(c.grow(4));
        assert!(!c.grow(usize::MAX)); // no overflow
        assert_eq!(b.used(), 10);
        drop(a);
        assert_eq!(b.used(), 4);
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_split_share_keeps_its_bytes_counted_until_dropped_and_the_peak_is_read_once() {
        let b = Budget::new(100);
        let mut line = b.share();
        assert!(line.grow(70));
        let sent = line.split_beyond(20); // 50 bytes leave with a piece; 20 stay held
        assert_eq!((line.held(), sent.held(), b.used()), (20, 50, 70));
        assert_eq!(line.split_beyond(30).held(), 0); // nothing beyond what it holds
        assert_eq!(b.used(), 70);
        drop(line);
        assert_eq!(b.used(), 50); // the piece is not written yet: still counted
        drop(sent);
        assert_eq!(b.used(), 0);
        assert_eq!(b.take_peak(), 70);
        assert_eq!(b.take_peak(), 0); // a new count from what is held now
    }

    #[test]
    fn large_bodies_leave_room_for_small_ones() {
        let b = Budget::new(32 * SMALL_BODY);
        let mut large = b.share();
        assert!(!large.grow(32 * SMALL_BODY)); // the last 1/32nd is not for large bodies
        assert!(large.grow(31 * SMALL_BODY));
        let mut more = b.share();
        assert!(!more.grow(SMALL_BODY + 1)); // large: past what large bodies may fill
        assert!(more.grow(SMALL_BODY)); // small: fits in what is left
        assert!(!more.grow(1)); // no longer small, and the budget is full
        assert_eq!(b.used(), 32 * SMALL_BODY);
        drop(more);
        // A share beside a large body its request holds is large from its first byte.
        let mut stream = b.share().beside(2 * SMALL_BODY);
        assert!(!stream.grow(1));
        assert!(b.share().beside(SMALL_BODY / 2).grow(SMALL_BODY / 2));
        // A small body fits past the prefill ceiling, which large prefill bodies stop below.
        let b = Budget::new(64 * SMALL_BODY);
        let mut decode = b.share();
        assert!(decode.grow(50 * SMALL_BODY)); // past the prefill ceiling (48)
        assert!(!b.share().grow_within(2 * SMALL_BODY, b.prefill_ceiling()));
        let mut small = b.share();
        assert!(small.grow_within(SMALL_BODY, b.prefill_ceiling()));
        assert_eq!(b.used(), 51 * SMALL_BODY);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn one_holder_waits_at_a_time_so_holders_never_wait_on_each_other() {
        let b = Budget::new(100);
        let far = tokio::time::Instant::now() + std::time::Duration::from_secs(600);
        let (mut first, mut second, mut empty) = (b.share(), b.share(), b.share());
        assert!(first.grow(50) && second.grow(50));
        // Both hold half and want more: the first waits with the turn...
        let waiting = tokio::spawn(async move {
            let ok = first.grow_wait(30, 100, far).await;
            (ok, first)
        });
        tokio::task::yield_now().await;
        // ...the second, holding bytes too, gives up after the grace instead of waiting on the
        // first until the far deadline.
        let began = tokio::time::Instant::now();
        assert!(!second.grow_wait(30, 100, far).await);
        assert_eq!(began.elapsed(), HOLDER_GRACE);
        // An empty share beside bytes its request holds is a holder too: it gives up.
        let mut beside = b.share().beside(10);
        assert!(!beside.grow_wait(30, 100, far).await);
        assert_eq!(began.elapsed(), 2 * HOLDER_GRACE);
        // A share that holds nothing may still wait (it keeps no one from anything).
        let idle = tokio::spawn(async move {
            let ok = empty.grow_wait(20, 100, far).await;
            (ok, empty)
        });
        tokio::task::yield_now().await;
        drop(second); // the failed request gives its bytes back: both waiters fit
        let ((ok_first, first), (ok_empty, empty)) = (waiting.await.unwrap(), idle.await.unwrap());
        assert!(ok_first && ok_empty);
        assert_eq!(b.used(), 100);
        drop((first, empty));
        assert_eq!(b.used(), 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_holder_without_the_turn_gets_room_freed_within_the_grace() {
        let b = Budget::new(100);
        let far = tokio::time::Instant::now() + std::time::Duration::from_secs(600);
        let (mut first, mut second, mut third) = (b.share(), b.share(), b.share());
        assert!(first.grow(50) && second.grow(40) && third.grow(10));
        let waiting = tokio::spawn(async move {
            let ok = first.grow_wait(40, 100, far).await; // waits with the turn
            (ok, first)
        });
        tokio::task::yield_now().await;
        let freer = tokio::spawn(async move {
            tokio::time::sleep(HOLDER_GRACE / 2).await;
            drop(third); // a client read its bytes
        });
        let began = tokio::time::Instant::now();
        assert!(second.grow_wait(10, 100, far).await); // without the turn, within the grace
        assert_eq!(began.elapsed(), HOLDER_GRACE / 2);
        freer.await.unwrap();
        drop(second);
        let (ok, first) = waiting.await.unwrap();
        assert!(ok);
        assert_eq!(b.used(), 90);
        drop(first);
        assert_eq!(b.used(), 0);
    }

    /// Every interleaving of a few holders growing to the limit: some always finish (no state
    /// where all wait), and the budget is all given back.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn holders_growing_past_the_limit_never_all_wait() {
        for holders in 2..6usize {
            for step in [7usize, 13, 25, 40] {
                let b = Budget::new(100);
                let far = tokio::time::Instant::now() + std::time::Duration::from_secs(3600);
                let tasks: Vec<_> = (0..holders)
                    .map(|_| {
                        let mut share = b.share();
                        tokio::spawn(async move {
                            // An event of 60 bytes, arriving `step` at a time.
                            let mut got = 0;
                            while got < 60 {
                                let n = step.min(60 - got);
                                if !share.grow_wait(n, 100, far).await {
                                    return false;
                                }
                                got += n;
                                tokio::task::yield_now().await;
                            }
                            true // the event is whole: sent, and the share dropped
                        })
                    })
                    .collect();
                let mut finished = 0;
                for t in tasks {
                    finished += usize::from(t.await.unwrap());
                }
                // Nothing waited out the hour: every task ended by finishing or giving up.
                assert!(tokio::time::Instant::now() < far, "{holders} x {step}");
                assert!(
                    finished >= 1,
                    "{holders} holders, steps of {step}: none finished"
                );
                assert_eq!(b.used(), 0);
            }
        }
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_reply_waits_for_room_and_gets_it_when_bytes_are_freed() {
        let b = Budget::new(100);
        assert_eq!(b.prefill_ceiling(), 75);
        let mut holder = b.share();
        assert!(holder.grow(90));
        let mut waiter = b.share();
        let soon = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        // Past the ceiling forever: refused at once, without waiting.
        assert!(!waiter.grow_wait(80, b.prefill_ceiling(), soon).await);
        let waiting = tokio::spawn(async move {
            let ok = waiter.grow_wait(50, 100, soon).await;
            (ok, waiter)
        });
        tokio::task::yield_now().await;
        holder.shrink_to(40); // frees 50: the waiter fits now
        let (ok, waiter) = waiting.await.unwrap();
        assert!(ok);
        assert_eq!(b.used(), 90);
        drop((holder, waiter));
        assert_eq!(b.used(), 0);
        // No room before the deadline: refused when it passes.
        let mut full = b.share();
        assert!(full.grow(100));
        let mut late = b.share();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        assert!(!late.grow_wait(1, 100, deadline).await);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn large_replies_holding_nothing_take_room_in_the_order_they_came() {
        const SB: usize = SMALL_BODY;
        let b = Budget::new(64 * SB); // large bodies may fill 62 SB of it
        let far = tokio::time::Instant::now() + std::time::Duration::from_secs(600);
        let mut holder = b.share();
        assert!(holder.grow(60 * SB));
        let waiter = |n: usize, deadline| {
            let mut share = b.share();
            tokio::spawn(async move {
                let ok = share.grow_wait(n, 64 * SB, deadline).await;
                (ok, share)
            })
        };
        let first = waiter(10 * SB, far); // the first to come needs the most
        tokio::task::yield_now().await;
        let second = waiter(2 * SB, far);
        tokio::task::yield_now().await;
        assert_eq!(b.queued(), 2);
        holder.shrink_to(56 * SB); // room for the second (6 SB free), not the first
        tokio::task::yield_now().await;
        assert_eq!((b.queued(), b.used()), (2, 56 * SB)); // the second does not pass the first
                                                          // A small request is not held up by the queue.
        let mut small = b.share();
        assert!(small.grow_wait(SB, 64 * SB, far).await);
        drop(small);
        holder.shrink_to(40 * SB); // room for both: the first, then the second
        let ((ok1, s1), (ok2, s2)) = (first.await.unwrap(), second.await.unwrap());
        assert!(ok1 && ok2);
        assert_eq!((b.used(), b.queued()), (52 * SB, 0));
        drop((s1, s2));
        // One that gives up (its deadline passed, or its request was dropped) lets the next go.
        let soon = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
        let first = waiter(30 * SB, soon);
        tokio::task::yield_now().await;
        let second = waiter(10 * SB, far);
        tokio::task::yield_now().await;
        holder.shrink_to(45 * SB); // 17 SB free: not the first's 30
        let (ok1, _) = first.await.unwrap();
        let (ok2, _) = second.await.unwrap();
        assert!(!ok1 && ok2);
        assert_eq!(b.queued(), 0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_reply_that_could_never_fit_is_refused_at_once() {
        const SB: usize = SMALL_BODY;
        let b = Budget::new(64 * SB);
        let ceiling = b.prefill_ceiling(); // 48 SB, of which large bodies may fill 46
        let far = tokio::time::Instant::now() + std::time::Duration::from_secs(600);
        let mut reply = b.share();
        assert_eq!(reply.room(SB, ceiling), 64 * SB); // small: it may fill the budget
        assert_eq!(reply.room(47 * SB, ceiling), 46 * SB);
        let began = tokio::time::Instant::now();
        assert!(!reply.grow_wait(47 * SB, ceiling, far).await);
        assert_eq!(began.elapsed(), std::time::Duration::ZERO); // no wait
                                                                // What the request holds elsewhere counts against its room.
        assert_eq!(b.share().beside(6 * SB).room(SB, ceiling), 40 * SB);
        assert!(reply.grow_wait(46 * SB, ceiling, far).await);
    }

    #[test]
    fn a_reserve_set_aside_is_grown_into_first_and_given_back_on_drop() {
        let b = Budget::new(100);
        let mut prefill = b.share();
        assert!(prefill.grow(40));
        prefill.set_aside(20); // a body of 20, as many bytes again for decode's reply
        assert_eq!((prefill.held(), prefill.reserve(), b.used()), (20, 20, 40));
        let mut decode = prefill.take_reserve();
        assert_eq!((prefill.reserve(), decode.reserve()), (0, 20));
        assert!(decode.grow(15)); // from the reserve: counted already
        assert_eq!((decode.held(), decode.reserve(), b.used()), (15, 5, 40));
        assert!(!decode.grow(70)); // 5 from the reserve and 65 more: past the limit
        assert_eq!((decode.held(), decode.reserve(), b.used()), (15, 5, 40)); // as it was
        assert!(decode.grow(10)); // the reserve's 5, then 5 from the budget
        assert_eq!((decode.held(), decode.reserve(), b.used()), (25, 0, 45));
        let sent = decode.split_beyond(0); // pieces sent on carry their bytes
        drop(decode);
        assert_eq!(b.used(), 45);
        drop(sent);
        let unused = prefill.take_reserve(); // nothing left to take
        assert_eq!(unused.reserve(), 0);
        prefill.set_aside(5);
        drop(prefill); // held and reserve both given back
        assert_eq!(b.used(), 0);
    }
}
