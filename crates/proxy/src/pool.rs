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
mod tests;
