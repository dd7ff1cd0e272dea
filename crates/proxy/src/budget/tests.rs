//! The tests of `budget`.

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
