//! Memory given back to the system after a burst of large bodies, and large buffers given
//! pages of their own.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::proxy::Proxy;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
use super::stream_merger::OWN_PAGES_ABOVE;

/// Bodies freed since memory was last given back, past which it is given back at once.
pub(crate) const GIVE_BACK_AFTER: usize = 64 << 20;

/// After a burst, glibc keeps the freed body buffers mapped. Hand the free memory back to the
/// system once the budget has fallen far below its peak since the last time (a burst ended,
/// even with other requests still in flight), or after a few quiet seconds.
pub(crate) async fn give_back_memory(proxy: Arc<Proxy>) {
    let mut quiet_ticks = 0u32;
    let mut trimmed = true;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (used, peak) = (proxy.budget.used(), proxy.budget.peak());
        if burst_ended(used, peak) {
            proxy.budget.take_peak();
            give_back().await;
            continue;
        }
        if proxy.in_flight.load(Ordering::Relaxed) > 0 || used > 0 {
            quiet_ticks = 0;
            trimmed = false;
            continue;
        }
        quiet_ticks += 1;
        if !trimmed && quiet_ticks >= 3 {
            trimmed = true;
            give_back().await;
        }
    }
}

/// Whether a burst has ended: the budget holds half its peak since memory was last given back
/// or less, and at least [`GIVE_BACK_AFTER`] bytes fewer.
pub(crate) fn burst_ended(used: usize, peak: usize) -> bool {
    peak.saturating_sub(used) >= GIVE_BACK_AFTER.max(peak / 2)
}

/// The heap's free pages back to the system, on a blocking thread (it walks the heap).
pub(crate) async fn give_back() {
    let _ = tokio::task::spawn_blocking(trim_heap).await;
}

/// Body buffers past [`OWN_PAGES_ABOVE`] get pages of their own from the system (mmap), given
/// back the moment they are freed; smaller ones reuse the heap's warm pages (no page faults).
/// glibc raises its threshold for mapping a buffer to the size of the last large buffer freed
/// (up to 32 MiB), after which long-context bodies come from the heap and stay resident once
/// freed until the heap is trimmed: under 24 streams of 16 MiB events, resident memory ran to
/// 3.5x the bytes the budget held. A fixed threshold keeps the large ones at what the budget
/// counts, for a page fault per 4 KiB of each new one (a cost that 256 KiB, tried first, put on
/// every 4 MB body too: 8.5 ms of CPU a request where 5.3 ms had been).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn map_large_buffers() {
    // SAFETY: mallopt only sets a tuning value of the allocator; it takes no pointers, and a
    // threshold of 256 KiB is within its accepted range.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, OWN_PAGES_ABOVE as libc::c_int);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn map_large_buffers() {}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn trim_heap() {
    // SAFETY: malloc_trim only returns free heap pages to the system; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn trim_heap() {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_given_back_once_a_burst_has_freed_half_its_peak() {
        const MIB: usize = 1 << 20;
        assert!(!burst_ended(0, 0)); // nothing ever held
        assert!(!burst_ended(0, 32 * MIB)); // a small burst: the quiet rule is enough
        assert!(burst_ended(0, 64 * MIB));
        assert!(burst_ended(500 * MIB, 1000 * MIB)); // requests still in flight
        assert!(!burst_ended(600 * MIB, 1000 * MIB)); // still most of the peak
        assert!(!burst_ended(1000 * MIB, 1000 * MIB));
    }
}
