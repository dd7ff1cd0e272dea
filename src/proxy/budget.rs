//! The budget of bytes held in bodies at once (`max_buffered_bytes`): client bodies being
//! received and upstream bodies being read, held or merged. A client body that would go past
//! it is refused (503 + Retry-After). An upstream reply waits for room instead (it stays in the
//! socket meanwhile: TCP pushes back on the server), for a bounded time; prefill replies may
//! fill only three quarters of the budget, so decode replies, which finish requests and free
//! their bytes, always have room to make progress.
//!
//! **No lock-up.** A share that holds bytes and waits for more (a stream's partial event, a
//! reply half read) keeps others from the bytes it holds; if every holder waited on another,
//! none would ever finish. So only one share that holds bytes may wait at a time (the turn); a
//! holder that finds the turn taken gives up at once (its request fails cleanly and its bytes
//! come back), and a share that holds nothing may always wait. Then no state has every holder
//! waiting: the one with the turn waits on bytes that holders without it either keep growing
//! and finish with, or give back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The process-wide count of bytes held, against its limit.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    limit: usize,
    freed: Notify,
    /// The turn to wait while holding bytes (see the module's doc).
    turn: tokio::sync::Mutex<()>,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            limit,
            freed: Notify::new(),
            turn: tokio::sync::Mutex::new(()),
        })
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

    /// An empty share of the budget, which grows as a body arrives and gives its bytes back
    /// when dropped.
    pub fn share(self: &Arc<Self>) -> Share {
        Share {
            budget: Arc::clone(self),
            held: 0,
        }
    }
}

/// The bytes of one body counted against the budget; given back on drop.
#[derive(Debug)]
pub struct Share {
    budget: Arc<Budget>,
    held: usize,
}

impl Share {
    /// Take `n` more bytes; `false` (nothing taken) when that would pass the limit.
    pub fn grow(&mut self, n: usize) -> bool {
        let limit = self.budget.limit;
        self.grow_within(n, limit)
    }

    /// Take `n` more bytes once the budget has room below `ceiling`, waiting until then
    /// (until `deadline` at most); `false` (nothing taken) if it never came, or at once if this
    /// share holds bytes and another holder is already waiting (the module's no-lock-up rule).
    pub async fn grow_wait(
        &mut self,
        n: usize,
        ceiling: usize,
        deadline: tokio::time::Instant,
    ) -> bool {
        if self.grow_within(n, ceiling) {
            return true;
        }
        if n > ceiling {
            return false; // it can never fit
        }
        let budget = Arc::clone(&self.budget);
        let _turn = match self.held {
            0 => None,
            _ => match budget.turn.try_lock() {
                Ok(turn) => Some(turn),
                Err(_) => return false,
            },
        };
        loop {
            let freed = budget.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable(); // registered before the check: no wake-up is missed
            if self.grow_within(n, ceiling) {
                return true;
            }
            tokio::select! {
                _ = freed => {}
                _ = tokio::time::sleep_until(deadline) => return false,
            }
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

    fn grow_within(&mut self, n: usize, ceiling: usize) -> bool {
        let b = &self.budget;
        let mut used = b.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = used.checked_add(n).filter(|&t| t <= ceiling) else {
                return false;
            };
            match b
                .used
                .compare_exchange_weak(used, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(now) => used = now,
            }
        }
        self.held += n;
        true
    }
}

impl Drop for Share {
    fn drop(&mut self) {
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
        // ...the second, holding bytes too, gives up at once instead of waiting on the first.
        let began = tokio::time::Instant::now();
        assert!(!second.grow_wait(30, 100, far).await);
        assert_eq!(began.elapsed(), std::time::Duration::ZERO);
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
}
