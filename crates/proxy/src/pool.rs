//! The servers of one side (prefill or decode): round robin over those in rotation, and passive
//! health checks. A server that fails `eject_after` times in a row (no connection, a timeout, a
//! broken reply, a 5xx) leaves the rotation for `eject_seconds`; then it gets one trial request
//! at a time until one succeeds. When every server of a side is out, the one due first is
//! probed (`GET /health`) before a request is refused, so failures alone never shut the last
//! server of a side out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

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

/// One server: where it is, and its health.
pub struct Upstream {
    /// Its side.
    pub side: Side,
    /// Its base URL as given, without a trailing slash.
    pub url: String,
    /// Where requests go.
    pub target: Target,
}

/// An upstream picked for one request; `trial` when it is out of rotation and on trial.
/// Give it back with [`Pool::release`].
#[derive(Debug)]
pub struct Lease {
    /// The upstream's position in its pool.
    pub index: usize,
    /// Whether this request is its trial.
    pub trial: bool,
}

/// One upstream's health as `/health` shows it.
pub struct Status<'a> {
    /// Its URL.
    pub url: &'a str,
    /// In rotation.
    pub healthy: bool,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// Seconds until it may be tried again (0 while healthy).
    pub retry_in: f64,
}

/// Round robin over one side's upstreams, skipping those out of rotation.
pub struct Pool {
    /// Its side.
    pub side: Side,
    /// Its servers, in the order given.
    pub upstreams: Vec<Upstream>,
    eject_after: u32,
    eject_for: Duration,
    state: Mutex<PoolState>,
}

struct PoolState {
    next: usize,
    health: Vec<Health>,
}

/// A health change the caller reports (log line, metric): `(index, healthy)`.
pub type Change = Option<(usize, bool)>;

impl Pool {
    /// The pool of `urls` (checked by `Config::check` first).
    pub fn new(side: Side, urls: &[String], eject_after: u32, eject_for: Duration) -> Self {
        let upstreams = urls
            .iter()
            .map(|url| Upstream {
                side,
                url: url.trim_end_matches('/').to_string(),
                target: Target::parse(url).expect("URLs are checked by Config::check"),
            })
            .collect::<Vec<_>>();
        let health = upstreams
            .iter()
            .map(|_| Health {
                failures: 0,
                ejected_until: None,
                trials: 0,
                probed_at: None,
            })
            .collect();
        Pool {
            side,
            upstreams,
            eject_after,
            eject_for,
            state: Mutex::new(PoolState { next: 0, health }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        // The state stays consistent at every await-free step, so a poisoned lock (a panic
        // elsewhere while it was held) still holds usable counts.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn healthy(&self, h: &Health) -> bool {
        h.failures < self.eject_after
    }

    /// The upstream for a request: with a `session` key, the one of the upstreams in rotation
    /// (not `avoid`) that the key ranks first (rendezvous hashing: a session's turns meet the
    /// same server, and its prefix cache, for as long as that server stays in rotation; a
    /// server leaving moves only its own sessions); without one, the next in rotation. Else one
    /// whose ejection is over and that has no trial under way; `None` when there is neither.
    pub fn pick(&self, avoid: Option<usize>, session: Option<u64>) -> Option<Lease> {
        let now = Instant::now();
        let mut s = self.lock();
        let n = self.upstreams.len();
        if let Some(key) = session {
            let ranked = (0..n)
                .filter(|&i| Some(i) != avoid && self.healthy(&s.health[i]))
                .max_by_key(|&i| rank(key, &self.upstreams[i].url));
            if let Some(index) = ranked {
                return Some(Lease {
                    index,
                    trial: false,
                });
            }
        }
        for i in 0..n {
            let index = (s.next + i) % n;
            if Some(index) == avoid {
                continue;
            }
            let h = &s.health[index];
            if self.healthy(h) {
                s.next = (index + 1) % n;
                return Some(Lease {
                    index,
                    trial: false,
                });
            }
            if h.ejected_until.is_none_or(|t| now >= t) && h.trials == 0 {
                s.health[index].trials += 1;
                return Some(Lease { index, trial: true });
            }
        }
        None
    }

    /// When nothing can be picked: the out-of-rotation upstream to probe before refusing (the
    /// one whose ejection ends first, with no trial or probe under way and none probed in the
    /// last `interval`), reserved as a trial; `None` when there is none.
    pub fn probe_candidate(&self, interval: Duration) -> Option<usize> {
        let now = Instant::now();
        let mut s = self.lock();
        let index = s
            .health
            .iter()
            .enumerate()
            .filter(|(_, h)| {
                !self.healthy(h)
                    && h.trials == 0
                    && h.probed_at
                        .is_none_or(|t| now.duration_since(t) >= interval)
            })
            .min_by_key(|(_, h)| h.ejected_until)
            .map(|(i, _)| i)?;
        let h = &mut s.health[index];
        h.trials += 1;
        h.probed_at = Some(now);
        Some(index)
    }

    /// The outcome of a probe: a trial lease when the server answered (the request it serves
    /// decides whether it rejoins), else `None`.
    pub fn probed(&self, index: usize, answered: bool) -> Option<Lease> {
        if answered {
            return Some(Lease { index, trial: true });
        }
        self.lock().health[index].trials -= 1;
        None
    }

    /// Record how a request to the leased upstream ended; returns a change of rotation to
    /// report.
    pub fn release(&self, lease: Lease, outcome: Outcome) -> Change {
        let mut s = self.lock();
        let h = &mut s.health[lease.index];
        if lease.trial {
            h.trials = h.trials.saturating_sub(1);
        }
        let was_healthy = h.failures < self.eject_after;
        match outcome {
            Outcome::Ok => {
                h.failures = 0;
                (!was_healthy).then_some((lease.index, true))
            }
            Outcome::Failed => {
                h.failures = h.failures.saturating_add(1);
                if h.failures >= self.eject_after {
                    h.ejected_until = Some(Instant::now() + self.eject_for);
                    if h.failures == self.eject_after || lease.trial {
                        log::warn!(
                            target: "routed_experts::proxy",
                            "{} server {} failed {} times in a row: out of rotation for {} s",
                            self.side.name(),
                            self.upstreams[lease.index].url,
                            h.failures,
                            self.eject_for.as_secs_f64()
                        );
                    }
                }
                (was_healthy && h.failures >= self.eject_after).then_some((lease.index, false))
            }
            Outcome::Unknown => None,
        }
    }

    /// Whole seconds until an upstream of this side may be tried again (at least 1).
    pub fn retry_after(&self) -> u64 {
        let now = Instant::now();
        let s = self.lock();
        let wait = s
            .health
            .iter()
            .map(|h| {
                h.ejected_until
                    .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64())
            })
            .fold(f64::INFINITY, f64::min);
        (wait.ceil() as u64).max(1)
    }

    /// Each upstream's health, for `/health`.
    pub fn status(&self) -> Vec<Status<'_>> {
        let now = Instant::now();
        let s = self.lock();
        self.upstreams
            .iter()
            .zip(&s.health)
            .map(|(u, h)| {
                let healthy = self.healthy(h);
                Status {
                    url: &u.url,
                    healthy,
                    consecutive_failures: h.failures,
                    retry_in: if healthy {
                        0.0
                    } else {
                        h.ejected_until
                            .map_or(0.0, |t| t.saturating_duration_since(now).as_secs_f64())
                    },
                }
            })
            .collect()
    }

    /// Whether any upstream is in rotation.
    pub fn any_healthy(&self) -> bool {
        self.lock().health.iter().any(|h| self.healthy(h))
    }
}

/// How highly the session `key` ranks the server at `url` (a fixed hash of both: the same on
/// every proxy and every run, so proxies beside each other agree).
fn rank(key: u64, url: &str) -> u64 {
    let mut h = fnv(FNV_OFFSET ^ key.wrapping_mul(FNV_PRIME), url.as_bytes());
    // A final mix, so URLs that differ in their last byte do not rank in step.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// A session's key: a fixed hash of its id's JSON text.
pub fn session_key(id: &[u8]) -> u64 {
    fnv(FNV_OFFSET, id)
}

/// FNV-1a over `bytes`, from `h`.
fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize, eject_after: u32, eject_for: Duration) -> Pool {
        let urls: Vec<String> = (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 1000 + i))
            .collect();
        Pool::new(Side::Decode, &urls, eject_after, eject_for)
    }

    #[test]
    fn a_session_meets_the_same_server_and_a_server_leaving_moves_only_its_sessions() {
        let urls: Vec<String> = (1..=4).map(|i| format!("http://10.0.0.{i}:8000")).collect();
        let p = Pool::new(Side::Prefill, &urls, 1, Duration::from_secs(60));
        let keys: Vec<u64> = (0..400)
            .map(|i| session_key(format!("\"s{i}\"").as_bytes()))
            .collect();
        let first: Vec<usize> = keys
            .iter()
            .map(|&k| p.pick(None, Some(k)).unwrap().index)
            .collect();
        // The same server every time, and the sessions spread over all four.
        for (&k, &i) in keys.iter().zip(&first) {
            assert_eq!(p.pick(None, Some(k)).unwrap().index, i);
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
            let now = p.pick(None, Some(k)).unwrap().index;
            if i == 2 {
                assert_ne!(now, 2);
            } else {
                assert_eq!(now, i);
            }
        }
        // `avoid` (a server that refused the connection) is skipped for the retry.
        assert_ne!(
            p.pick(Some(first[0]), Some(keys[0])).unwrap().index,
            first[0]
        );
    }

    #[test]
    fn round_robin_skips_ejected_servers_and_trials_one_at_a_time() {
        let p = pool(2, 2, Duration::ZERO);
        let order: Vec<usize> = (0..4)
            .map(|_| {
                let l = p.pick(None, None).unwrap();
                let i = l.index;
                p.release(l, Outcome::Ok);
                i
            })
            .collect();
        assert_eq!(order, [0, 1, 0, 1]);
        for _ in 0..2 {
            let l = p.pick(Some(1), None).unwrap();
            assert_eq!(l.index, 0);
            p.release(l, Outcome::Failed);
        }
        assert_eq!(p.status()[0].consecutive_failures, 2);
        assert!(!p.status()[0].healthy);
        // Ejection of zero seconds: 0 gets one trial; while it runs, only 1 is picked.
        let trial = p.pick(Some(1), None).unwrap();
        assert!(trial.trial && trial.index == 0);
        assert!(p.pick(Some(1), None).is_none());
        assert_eq!(p.release(trial, Outcome::Ok), Some((0, true)));
        assert!(p.status()[0].healthy);
    }

    #[test]
    fn the_last_server_is_probed_at_most_once_per_interval() {
        let p = pool(1, 1, Duration::from_secs(60));
        let l = p.pick(None, None).unwrap();
        assert_eq!(p.release(l, Outcome::Failed), Some((0, false)));
        assert!(p.pick(None, None).is_none());
        assert_eq!(p.retry_after(), 60);
        let probe = p.probe_candidate(Duration::from_secs(1)).unwrap();
        assert!(p.probe_candidate(Duration::from_secs(1)).is_none()); // under way
        assert!(p.probed(probe, false).is_none());
        assert!(p.probe_candidate(Duration::from_secs(1)).is_none()); // probed a moment ago
        assert!(p.probe_candidate(Duration::ZERO).is_some());
    }
}
