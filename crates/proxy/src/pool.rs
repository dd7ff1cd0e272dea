//! [`Pool`]: the servers of one side (prefill or decode), which of them are in rotation
//! (passive health checks), the lease a request holds on one, and the list changed while
//! running. Which server in rotation serves a request is the side's [`Policy`] (`policy.rs`).
//!
//! A server that fails `eject_after` times in a row (no connection, a timeout, a broken reply, a
//! 5xx) leaves the rotation for `eject_seconds`; then it gets one trial request at a time until
//! one succeeds. When every server of a side is out, the one due first is probed (`GET
//! /health`) before a request is refused, so failures alone never shut the last server of a
//! side out. A server removed while requests are under way keeps serving them: each request
//! holds its server ([`Lease`]), not a position in the list.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::config_error::ConfigError;
use super::policy::{Choice, Policy, ServerLoad, SessionMemory};
use super::upstream::Target;

/// Which half of the protocol a server serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Computes the prompt and keeps its KV cache for decode.
    Prefill,
    /// Fetches the KV cache and generates.
    Decode,
}

impl Side {
    /// "prefill" or "decode", as logs, metrics and error bodies name it.
    pub fn name(self) -> &'static str {
        match self {
            Side::Prefill => "prefill",
            Side::Decode => "decode",
        }
    }

    /// The side `name` names.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "prefill" => Some(Side::Prefill),
            "decode" => Some(Side::Decode),
            _ => None,
        }
    }
}

/// How a request to an upstream ended, for its health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It answered (a 4xx is the client's fault, not the server's).
    Ok,
    /// No connection, a timeout, a broken reply or a 5xx.
    Failed,
    /// The client left before it was known.
    Unknown,
}

impl Outcome {
    /// What an answer's status says of the server: a 5xx is its failure; anything else (a 4xx
    /// is about the request) means it works.
    pub fn of_status(status: u16) -> Self {
        if status >= 500 {
            Outcome::Failed
        } else {
            Outcome::Ok
        }
    }
}

struct Health {
    failures: u32,
    ejected_until: Option<Instant>,
    trials: u32,
    probed_at: Option<Instant>,
}

impl Health {
    fn new() -> Self {
        Health {
            failures: 0,
            ejected_until: None,
            trials: 0,
            probed_at: None,
        }
    }
}

/// One server: where it is, and the requests it is serving.
#[derive(Debug)]
pub struct Upstream {
    /// Its base URL as given, without a trailing slash.
    pub url: String,
    /// Where requests go.
    pub target: Target,
    in_flight: AtomicUsize,
}

impl Upstream {
    fn new(url: &str) -> Result<Arc<Self>, String> {
        Ok(Arc::new(Upstream {
            url: url.trim_end_matches('/').to_string(),
            target: Target::parse(url)?,
            in_flight: AtomicUsize::new(0),
        }))
    }

    /// Requests it is serving now (leases not yet dropped).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }
}

/// An upstream picked for one request; `trial` when it is out of rotation and on trial. Give it
/// back with [`Pool::release`]; it counts as one of the server's requests under way until it
/// is dropped.
#[derive(Debug)]
pub struct Lease {
    /// The server.
    pub upstream: Arc<Upstream>,
    /// Whether this request is its trial.
    pub trial: bool,
    /// Why it was picked.
    pub choice: Choice,
}

impl Lease {
    fn new(upstream: &Arc<Upstream>, choice: Choice) -> Self {
        upstream.in_flight.fetch_add(1, Ordering::AcqRel);
        Lease {
            upstream: Arc::clone(upstream),
            trial: choice == Choice::Trial,
            choice,
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.upstream.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One upstream's health as `/health` shows it.
pub struct Status {
    /// Its URL.
    pub url: String,
    /// In rotation.
    pub healthy: bool,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Seconds until it may be tried again (0 while healthy).
    pub retry_in: f64,
    /// Requests it is serving.
    pub in_flight: usize,
}

/// One side's upstreams, picked by its policy, skipping those out of rotation.
pub struct Pool {
    /// Its side.
    pub side: Side,
    /// How it picks.
    pub policy: Policy,
    eject_after: u32,
    eject_for: Duration,
    state: Mutex<PoolState>,
}

struct Member {
    upstream: Arc<Upstream>,
    health: Health,
}

struct PoolState {
    next: usize,
    members: Vec<Member>,
    last: SessionMemory,
}

/// A health change the caller reports (log line, metric): `(url, healthy)`.
pub type Change = Option<(String, bool)>;

/// What a change of the list did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changed {
    /// URLs added.
    pub added: Vec<String>,
    /// URLs removed.
    pub removed: Vec<String>,
}

impl Pool {
    /// The pool of `urls` (each once; a URL given twice is one server), picking by `policy`;
    /// `Err` names a URL that is not one, or says the list is empty.
    pub fn new(
        side: Side,
        urls: &[String],
        policy: Policy,
        eject_after: u32,
        eject_for: Duration,
    ) -> Result<Self, ConfigError> {
        let pool = Pool {
            side,
            policy,
            eject_after,
            eject_for,
            state: Mutex::new(PoolState {
                next: 0,
                members: Vec::new(),
                last: SessionMemory::default(),
            }),
        };
        pool.replace(urls)?;
        Ok(pool)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // The state stays consistent at every await-free step, so a poisoned lock (a panic
        // elsewhere while it was held) still holds usable counts.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn healthy(&self, h: &Health) -> bool {
        h.failures < self.eject_after
    }

    /// The upstream for a request. First a server whose ejection is over and that has no trial
    /// under way (its trial); else, among those in rotation but `avoid`, the one the policy
    /// picks (`session`: the request's session key, if it has one); `None` when there is
    /// neither.
    pub fn pick(&self, avoid: Option<&Upstream>, session: Option<u64>) -> Option<Lease> {
        let now = Instant::now();
        let mut s = self.lock();
        let n = s.members.len();
        let start = s.next;
        let avoided = |m: &Member| avoid.is_some_and(|a| std::ptr::eq(a, &*m.upstream));
        // In rotation order from the next, so trials and ties take turns.
        let order: Vec<usize> = (0..n).map(|i| (start + i) % n).collect();
        for &i in &order {
            let m = &mut s.members[i];
            let h = &m.health;
            if !avoided(m)
                && !self.healthy(h)
                && h.trials == 0
                && h.ejected_until.is_none_or(|t| now >= t)
            {
                m.health.trials += 1;
                s.next = (i + 1) % n;
                return Some(Lease::new(&s.members[i].upstream, Choice::Trial));
            }
        }
        let candidates: Vec<usize> = order
            .into_iter()
            .filter(|&i| !avoided(&s.members[i]) && self.healthy(&s.members[i].health))
            .collect();
        let state = &mut *s;
        let servers: Vec<ServerLoad> = state
            .members
            .iter()
            .map(|m| ServerLoad {
                url: &m.upstream.url,
                load: m.upstream.in_flight(),
            })
            .collect();
        let (index, choice) =
            self.policy
                .choose(&servers, &candidates, session, &mut state.last)?;
        if !choice.by_session() {
            state.next = (index + 1) % n;
        }
        Some(Lease::new(&s.members[index].upstream, choice))
    }

    /// When nothing can be picked: the out-of-rotation upstream to probe before refusing (the
    /// one whose ejection ends first, with no trial or probe under way and none probed in the
    /// last `interval`), reserved as a trial; `None` when there is none.
    pub fn probe_candidate(&self, interval: Duration) -> Option<Arc<Upstream>> {
        let now = Instant::now();
        let mut s = self.lock();
        let m = s
            .members
            .iter_mut()
            .filter(|m| {
                let h = &m.health;
                h.failures >= self.eject_after
                    && h.trials == 0
                    && h.probed_at
                        .is_none_or(|t| now.duration_since(t) >= interval)
            })
            .min_by_key(|m| m.health.ejected_until)?;
        m.health.trials += 1;
        m.health.probed_at = Some(now);
        Some(Arc::clone(&m.upstream))
    }

    /// The outcome of a probe: a trial lease when the server answered (the request it serves
    /// decides whether it rejoins), else `None`.
    pub fn probed(&self, upstream: &Arc<Upstream>, answered: bool) -> Option<Lease> {
        if answered {
            return Some(Lease::new(upstream, Choice::Trial));
        }
        if let Some(m) = self.lock().member(upstream) {
            m.health.trials = m.health.trials.saturating_sub(1);
        }
        None
    }

    /// Record how a request to the leased upstream ended; returns a change of rotation to
    /// report. A server removed meanwhile has no health to record.
    pub fn release(&self, lease: Lease, outcome: Outcome) -> Change {
        let mut s = self.lock();
        let m = s.member(&lease.upstream)?;
        let h = &mut m.health;
        if lease.trial {
            h.trials = h.trials.saturating_sub(1);
        }
        let was_healthy = h.failures < self.eject_after;
        let url = &m.upstream.url;
        match outcome {
            Outcome::Ok => {
                h.failures = 0;
                (!was_healthy).then(|| (url.clone(), true))
            }
            Outcome::Failed => {
                h.failures = h.failures.saturating_add(1);
                if h.failures >= self.eject_after {
                    h.ejected_until = Some(Instant::now() + self.eject_for);
                    if h.failures == self.eject_after || lease.trial {
                        log::warn!(
                            target: "routed_experts::proxy",
                            "{} server {url} failed {} times in a row: out of rotation for {} s",
                            self.side.name(),
                            h.failures,
                            self.eject_for.as_secs_f64()
                        );
                    }
                }
                (was_healthy && h.failures >= self.eject_after).then(|| (url.clone(), false))
            }
            Outcome::Unknown => None,
        }
    }

    /// Add the server at `url`, in rotation; `Ok(false)` when it is already there.
    pub fn add(&self, url: &str) -> Result<bool, ConfigError> {
        let upstream = Upstream::new(url).map_err(|e| ConfigError::new(self.side.name(), e))?;
        let mut s = self.lock();
        if s.members.iter().any(|m| m.upstream.url == upstream.url) {
            return Ok(false);
        }
        s.members.push(Member {
            upstream,
            health: Health::new(),
        });
        Ok(true)
    }

    /// Take the server at `url` out of the list (requests it is serving finish there);
    /// `Ok(false)` when it is not there; `Err` when it is the side's last server.
    pub fn remove(&self, url: &str) -> Result<bool, ConfigError> {
        let url = url.trim_end_matches('/');
        let mut s = self.lock();
        let Some(i) = s.members.iter().position(|m| m.upstream.url == url) else {
            return Ok(false);
        };
        if s.members.len() == 1 {
            let side = self.side.name();
            let message = format!("{url} is the last {side} server: add another first");
            return Err(ConfigError::new(side, message));
        }
        s.members.remove(i);
        let n = s.members.len();
        s.next %= n;
        Ok(true)
    }

    /// Make the list `urls` (in that order): servers that stay keep their health, those not in
    /// it are removed. All or nothing: `Err` names a URL that is not one, or says it is empty.
    pub fn replace(&self, urls: &[String]) -> Result<Changed, ConfigError> {
        let side = self.side.name();
        if urls.is_empty() {
            return Err(ConfigError::new(
                side,
                format!("give at least one {side} server"),
            ));
        }
        let mut wanted: Vec<Arc<Upstream>> = Vec::with_capacity(urls.len());
        for url in urls {
            let u =
                Upstream::new(url).map_err(|e| ConfigError::new(side, format!("{side}: {e}")))?;
            if !wanted.iter().any(|w| w.url == u.url) {
                wanted.push(u);
            }
        }
        let mut s = self.lock();
        let mut old: Vec<Member> = std::mem::take(&mut s.members);
        let mut changed = Changed::default();
        for u in wanted {
            match old.iter().position(|m| m.upstream.url == u.url) {
                Some(i) => s.members.push(old.swap_remove(i)),
                None => {
                    changed.added.push(u.url.clone());
                    s.members.push(Member {
                        upstream: u,
                        health: Health::new(),
                    });
                }
            }
        }
        changed.removed = old.into_iter().map(|m| m.upstream.url.clone()).collect();
        let n = s.members.len();
        s.next %= n;
        Ok(changed)
    }

    /// Its servers, in order.
    pub fn upstreams(&self) -> Vec<Arc<Upstream>> {
        self.lock()
            .members
            .iter()
            .map(|m| Arc::clone(&m.upstream))
            .collect()
    }

    /// Its servers' URLs, in order.
    pub fn urls(&self) -> Vec<String> {
        self.lock()
            .members
            .iter()
            .map(|m| m.upstream.url.clone())
            .collect()
    }

    /// Whole seconds until an upstream of this side may be tried again (at least 1).
    pub fn retry_after(&self) -> u64 {
        let now = Instant::now();
        let s = self.lock();
        let wait = s
            .members
            .iter()
            .map(|m| {
                m.health
                    .ejected_until
                    .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64())
            })
            .fold(f64::INFINITY, f64::min);
        (wait.ceil() as u64).max(1)
    }

    /// Each upstream's health, for `/health`.
    pub fn status(&self) -> Vec<Status> {
        let now = Instant::now();
        let s = self.lock();
        s.members
            .iter()
            .map(|m| {
                let h = &m.health;
                let healthy = self.healthy(h);
                Status {
                    url: m.upstream.url.clone(),
                    healthy,
                    consecutive_failures: h.failures,
                    retry_in: if healthy {
                        0.0
                    } else {
                        h.ejected_until
                            .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64())
                    },
                    in_flight: m.upstream.in_flight(),
                }
            })
            .collect()
    }

    /// Whether any upstream is in rotation.
    pub fn any_healthy(&self) -> bool {
        self.lock().members.iter().any(|m| self.healthy(&m.health))
    }
}

impl PoolState {
    fn member(&mut self, upstream: &Arc<Upstream>) -> Option<&mut Member> {
        self.members
            .iter_mut()
            .find(|m| Arc::ptr_eq(&m.upstream, upstream))
    }
}

#[cfg(test)]
mod tests {
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
}
