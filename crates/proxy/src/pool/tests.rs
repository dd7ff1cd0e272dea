//! The tests of `pool`.

use super::*;
use crate::policy::{session_cap, session_key};

fn urls(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("http://10.0.0.{i}:8000")).collect()
}

fn pool(n: usize, policy: Policy, eject_after: u32, eject_for: Duration) -> Pool {
    Pool::new(Side::Decode, &urls(n), policy, eject_after, eject_for).unwrap()
}

fn key(i: usize) -> u64 {
    session_key(format!("\"s{i}\"").as_bytes())
}

/// The server (by its place in `urls`) a lease holds.
fn place(l: &Lease) -> usize {
    urls(8).iter().position(|u| *u == l.upstream.url).unwrap()
}

#[test]
fn a_session_meets_the_same_server_and_a_server_leaving_moves_only_its_sessions() {
    let p = pool(4, Policy::Session, 1, Duration::from_secs(60));
    let keys: Vec<u64> = (0..400).map(key).collect();
    let first: Vec<usize> = keys
        .iter()
        .map(|&k| place(&p.pick(None, Some(k)).unwrap()))
        .collect();
    // The same server every time, and the sessions spread over all four.
    for (&k, &i) in keys.iter().zip(&first) {
        let l = p.pick(None, Some(k)).unwrap();
        assert_eq!((place(&l), l.choice), (i, Choice::Session));
    }
    for s in 0..4 {
        let n = first.iter().filter(|&&i| i == s).count();
        assert!(
            (60..=140).contains(&n),
            "server {s} got {n} of 400 sessions"
        );
    }
    // Server 2 fails out of rotation: only its sessions move, each to one other server.
    let l = p
        .pick(
            None,
            Some(keys[first.iter().position(|&i| i == 2).unwrap()]),
        )
        .unwrap();
    p.release(l, Outcome::Failed);
    for (&k, &i) in keys.iter().zip(&first) {
        let l = p.pick(None, Some(k)).unwrap();
        if i == 2 {
            assert_ne!(place(&l), 2);
            assert_eq!(l.choice, Choice::SessionMoved);
        } else {
            assert_eq!(place(&l), i);
        }
    }
    // `avoid` (a server that refused the connection) is skipped for the retry.
    let l = p.pick(None, Some(keys[0])).unwrap();
    assert_ne!(
        place(&p.pick(Some(&l.upstream), Some(keys[0])).unwrap()),
        first[0]
    );
}

#[test]
fn removing_a_server_moves_only_its_sessions_and_adding_one_moves_none() {
    let p = pool(4, Policy::Session, 3, Duration::from_secs(60));
    let place_of = |i: usize| place(&p.pick(None, Some(key(i))).unwrap());
    let before: Vec<usize> = (0..400).map(place_of).collect();
    assert_eq!(p.remove(&urls(4)[1]), Ok(true));
    assert_eq!(p.remove(&urls(4)[1]), Ok(false));
    let after: Vec<usize> = (0..400).map(place_of).collect();
    let moved = (0..400).filter(|&i| after[i] != before[i]).count();
    let on_1 = before.iter().filter(|&&s| s == 1).count();
    assert_eq!(moved, on_1);
    // Back, and a fifth: sessions already seen stay where their prefixes are cached...
    assert_eq!(p.add(&urls(4)[1]), Ok(true));
    assert_eq!(p.add(&format!("{}/", urls(4)[1])), Ok(false));
    assert_eq!(p.add(&urls(5)[4]), Ok(true));
    let now: Vec<usize> = (0..400).map(place_of).collect();
    assert_eq!(now, after);
    // ...and new sessions spread over all five, the new servers included.
    let mut per = [0usize; 5];
    for i in 400..900 {
        per[place_of(i)] += 1;
    }
    assert!(per.iter().all(|&n| (60..=140).contains(&n)), "{per:?}");
}

#[test]
fn a_session_that_moved_stays_where_its_last_request_went() {
    let p = pool(3, Policy::Session, 1, Duration::from_secs(60));
    let home = p.pick(None, Some(key(1))).unwrap();
    // Its home is avoided once (a refused connection): the retry goes elsewhere...
    let moved = p.pick(Some(&home.upstream), Some(key(1))).unwrap();
    assert_eq!(moved.choice, Choice::SessionMoved);
    assert_ne!(moved.upstream.url, home.upstream.url);
    // ...and the next turn follows it there, where its newest prefix is.
    let next = p.pick(None, Some(key(1))).unwrap();
    assert_eq!(
        (next.upstream.url.as_str(), next.choice),
        (moved.upstream.url.as_str(), Choice::Session)
    );
    // Its server removed and listed again before the next turn: the same server (by URL)
    // to the session, which returns to it.
    let url = moved.upstream.url.clone();
    drop((home, moved, next));
    assert_eq!(p.remove(&url), Ok(true));
    assert_eq!(p.add(&url), Ok(true));
    let back = p.pick(None, Some(key(1))).unwrap();
    assert_eq!(
        (back.upstream.url.as_str(), back.choice),
        (url.as_str(), Choice::Session)
    );
}

#[test]
fn the_last_server_cannot_be_removed_and_a_bad_list_changes_nothing() {
    let p = pool(2, Policy::LeastLoad, 3, Duration::from_secs(60));
    assert_eq!(p.remove(&urls(2)[0]), Ok(true));
    assert!(p
        .remove(&urls(2)[1])
        .unwrap_err()
        .message
        .contains("last decode server"));
    assert!(p.add("localhost:1").is_err());
    let bad = vec![urls(3)[2].clone(), "ftp://x".to_string()];
    assert!(p.replace(&bad).is_err());
    assert!(p.replace(&[]).unwrap_err().message.contains("at least one"));
    assert_eq!(p.urls(), [urls(2)[1].clone()]);
    let changed = p.replace(&urls(3)).unwrap();
    assert_eq!(changed.added, [urls(3)[0].clone(), urls(3)[2].clone()]);
    assert!(changed.removed.is_empty());
    assert_eq!(p.urls(), urls(3));
    let changed = p.replace(&urls(1)).unwrap();
    assert_eq!(changed.removed.len(), 2);
}

#[test]
fn a_removed_server_finishes_its_requests_and_its_lease_is_released_harmlessly() {
    let p = pool(2, Policy::RoundRobin, 1, Duration::from_secs(60));
    let l = p.pick(None, None).unwrap();
    assert_eq!(l.upstream.in_flight(), 1);
    p.remove(&l.upstream.url.clone()).unwrap();
    let upstream = Arc::clone(&l.upstream);
    assert_eq!(p.release(l, Outcome::Failed), None);
    assert_eq!(upstream.in_flight(), 0);
    assert!(p.pick(None, None).unwrap().upstream.url != upstream.url);
}

#[test]
fn least_load_picks_the_server_with_fewest_requests_under_way() {
    let p = pool(3, Policy::LeastLoad, 3, Duration::from_secs(60));
    let mut held: Vec<Lease> = (0..3).map(|_| p.pick(None, None).unwrap()).collect();
    let mut places: Vec<usize> = held.iter().map(place).collect();
    places.sort_unstable();
    assert_eq!(places, [0, 1, 2]);
    let second = p.pick(None, None).unwrap();
    drop(held.remove(1));
    let l = p.pick(None, None).unwrap();
    assert_eq!(l.choice, Choice::LeastLoad);
    assert_eq!(l.upstream.in_flight(), 1);
    assert_ne!(place(&l), place(&second));
    // A session policy's request without a key goes to the least loaded too.
    let s = pool(3, Policy::Session, 3, Duration::from_secs(60));
    let _a = s.pick(None, None).unwrap();
    let _b = s.pick(None, None).unwrap();
    let c = s.pick(None, None).unwrap();
    assert_eq!((c.choice, c.upstream.in_flight()), (Choice::LeastLoad, 1));
}

#[test]
fn one_hot_session_spills_past_the_load_bound() {
    let p = pool(4, Policy::Session, 3, Duration::from_secs(60));
    let held: Vec<Lease> = (0..40)
        .map(|_| p.pick(None, Some(key(7))).unwrap())
        .collect();
    let mut per = [0usize; 4];
    for l in &held {
        per[place(l)] += 1;
    }
    // No server holds more than the bound allows at the moment it was picked.
    let most = *per.iter().max().unwrap();
    assert!(most <= session_cap(39, 4), "{per:?}");
    assert!(held.iter().any(|l| l.choice == Choice::SessionMoved));
    // Below any real load a session stays put.
    assert_eq!(session_cap(0, 4), 2);
    assert_eq!(session_cap(15, 4), 6);
}

#[test]
fn round_robin_skips_ejected_servers_and_trials_one_at_a_time() {
    let p = pool(2, Policy::RoundRobin, 2, Duration::ZERO);
    let order: Vec<usize> = (0..4)
        .map(|_| {
            let l = p.pick(None, None).unwrap();
            let i = place(&l);
            p.release(l, Outcome::Ok);
            i
        })
        .collect();
    assert_eq!(order, [0, 1, 0, 1]);
    let _zero = p.pick(None, None).unwrap();
    let one = Arc::clone(&p.pick(None, None).unwrap().upstream);
    assert_eq!(place(&p.pick(Some(&one), None).unwrap()), 0);
    for _ in 0..2 {
        let l = p.pick(Some(&one), None).unwrap();
        assert_eq!(place(&l), 0);
        p.release(l, Outcome::Failed);
    }
    assert_eq!(p.status()[0].consecutive_failures, 2);
    assert!(!p.status()[0].healthy);
    // Ejection of zero seconds: 0 gets one trial; while it runs, only 1 is picked.
    let trial = p.pick(None, None).unwrap();
    assert!(trial.trial && place(&trial) == 0);
    assert!(p.pick(Some(&one), None).is_none());
    assert_eq!(place(&p.pick(None, None).unwrap()), 1);
    assert_eq!(
        p.release(trial, Outcome::Ok),
        Some((urls(2)[0].clone(), true))
    );
    assert!(p.status()[0].healthy);
}

#[test]
fn the_last_server_is_probed_at_most_once_per_interval() {
    let p = pool(1, Policy::RoundRobin, 1, Duration::from_secs(60));
    let l = p.pick(None, None).unwrap();
    assert_eq!(
        p.release(l, Outcome::Failed),
        Some((urls(1)[0].clone(), false))
    );
    assert!(p.pick(None, None).is_none());
    assert_eq!(p.retry_after(), 60);
    let probe = p.probe_candidate(Duration::from_secs(1)).unwrap();
    assert!(p.probe_candidate(Duration::from_secs(1)).is_none()); // under way
    assert!(p.probed(&probe, false).is_none());
    assert!(p.probe_candidate(Duration::from_secs(1)).is_none()); // probed a moment ago
    assert!(p.probe_candidate(Duration::ZERO).is_some());
}

#[test]
fn policies_are_named() {
    for p in Policy::ALL {
        assert_eq!(Policy::parse(p.name()), Ok(p));
    }
    assert!(Policy::parse("cache_aware")
        .unwrap_err()
        .contains("round_robin, least_load, session"));
}
