//! The budget of bytes held in bodies at once (`max_buffered_bytes`): client bodies being
//! received and upstream bodies being read, held or merged. A request that would go past it is
//! refused (503 + Retry-After) instead of growing the process without bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The process-wide count of bytes held, against its limit.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    limit: usize,
}

impl Budget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            limit,
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit
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
        let b = &self.budget;
        let mut used = b.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = used.checked_add(n).filter(|&t| t <= b.limit) else {
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
        self.budget.used.fetch_sub(self.held, Ordering::Relaxed);
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
}
