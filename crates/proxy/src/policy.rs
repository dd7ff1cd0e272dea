//! [`Policy`]: which server of a side serves a request, among those in rotation; the pool
//! (`pool.rs`) decides which servers are in rotation and gives the chosen one its lease. A new
//! policy is a variant, its name in [`Policy::name`], its place in [`Policy::ALL`] and its arm
//! of [`Policy::choose`], then its flag's help in `config.rs` (docs/architecture.md, "Adding a
//! proxy policy", lists every place).

use std::collections::HashMap;

/// How a side picks the server for a request among those in rotation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Each in turn.
    RoundRobin,
    /// The one with the fewest requests under way (ties in turn).
    LeastLoad,
    /// A request with a session key goes to the server its key ranks first (rendezvous
    /// hashing), unless that server holds more than [`SESSION_LOAD_FACTOR`] times the average
    /// load, in which case the next in its ranking that does not; a request without a key goes
    /// to the least loaded.
    Session,
}

/// The bound on a server's share under [`Policy::Session`]: a session's request goes to a
/// server only while its requests under way are below this factor times the side's average
/// (counting the request), so one hot session cannot swamp a server (consistent hashing with
/// bounded loads). 1.5, not the 1.25 often quoted: hashing itself leaves the busiest server
/// near 1.4x the average at RL concurrencies (64 sessions on 4 servers), and a session moved
/// in mid-rollout loses its cached prefix; measured in BENCHMARKS.md (sessions).
pub const SESSION_LOAD_FACTOR: f64 = 1.5;

impl Policy {
    /// Every policy, by name.
    pub const ALL: [Policy; 3] = [Policy::RoundRobin, Policy::LeastLoad, Policy::Session];

    /// Its name, as the command's flag takes it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastLoad => "least_load",
            Policy::Session => "session",
        }
    }

    /// The policy `name` names; `Err` lists the names.
    pub fn parse(name: &str) -> Result<Self, String> {
        super::config_error::parse_named(&Self::ALL, Self::name, name)
    }

    /// The server for a request, and why: one of `candidates` (indices into `servers`: those
    /// in rotation and not avoided, in turn order from the side's next), or `None` when there
    /// is none. `session` is the request's session key; `memory` is where the side's sessions
    /// last went, kept up to date here.
    pub(crate) fn choose(
        self,
        servers: &[ServerLoad<'_>],
        candidates: &[usize],
        session: Option<u64>,
        memory: &mut SessionMemory,
    ) -> Option<(usize, Choice)> {
        let load = |i: usize| servers[i].load;
        match (self, session) {
            (Policy::RoundRobin, _) => Some((*candidates.first()?, Choice::Turn)),
            (Policy::Session, Some(key)) => {
                // Where the session was last (if still listed and in rotation), then the
                // servers in the order its key ranks them.
                let last = memory.get(key);
                let at = |url: &str| servers.iter().position(|s| s.url == url);
                let last_candidate = last.and_then(at).filter(|i| candidates.contains(i));
                let rank_of = |i: usize| rank(key, servers[i].url);
                let mut ranked = candidates.to_vec();
                ranked.sort_by_cached_key(|&i| std::cmp::Reverse(rank_of(i)));
                let home = last_candidate.or(ranked.first().copied());
                let total: usize = candidates.iter().map(|&i| load(i)).sum();
                let cap = session_cap(total, candidates.len());
                // Some server is below the cap: were all at or above it, the total would be
                // at least their count times the cap, more than the total.
                let index = home
                    .into_iter()
                    .chain(ranked.iter().copied())
                    .find(|&i| load(i) < cap)
                    .or(home)?;
                // Its home unless the session had one out of rotation, or over the bound.
                let first = match last {
                    Some(url) => at(url),
                    None => (0..servers.len()).max_by_key(|&i| rank_of(i)),
                };
                let choice = if first == Some(index) {
                    Choice::Session
                } else {
                    Choice::SessionMoved
                };
                memory.put(key, servers[index].url);
                Some((index, choice))
            }
            _ => Some((
                candidates.iter().copied().min_by_key(|&i| load(i))?,
                Choice::LeastLoad,
            )),
        }
    }
}

/// What a policy sees of one server of the side: its URL (unique in the side) and the
/// requests it is serving.
pub(crate) struct ServerLoad<'a> {
    pub(crate) url: &'a str,
    pub(crate) load: usize,
}

/// Why a server was picked, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Its turn (round robin).
    Turn,
    /// The least loaded (least load, or a session policy's request without a key).
    LeastLoad,
    /// The server the request's session ranks first.
    Session,
    /// Not the session's first server: it was out of rotation, avoided or over the load bound.
    SessionMoved,
    /// A trial request to a server whose ejection is over.
    Trial,
}

impl Choice {
    /// Its metric label.
    pub fn name(self) -> &'static str {
        match self {
            Choice::Turn => "turn",
            Choice::LeastLoad => "least_load",
            Choice::Session => "session",
            Choice::SessionMoved => "session_moved",
            Choice::Trial => "trial",
        }
    }

    /// Whether the choice was the session policy's (which keeps the side's turn where it is).
    pub(crate) fn by_session(self) -> bool {
        matches!(self, Choice::Session | Choice::SessionMoved)
    }
}

/// Where each recent session's last request went (the server's URL), so a session that had to
/// move (its first server over the load bound) stays where its newest prefix now is; a server
/// removed and listed again under its URL is the same server. Bounded: two generations of at
/// most [`REMEMBERED_SESSIONS`] each; when the newer is full it becomes the older and the
/// older is forgotten (a forgotten session goes back to its first-ranked server).
#[derive(Default)]
pub(crate) struct SessionMemory {
    newer: HashMap<u64, String>,
    older: HashMap<u64, String>,
}

/// Sessions remembered per generation of [`SessionMemory`].
const REMEMBERED_SESSIONS: usize = 1 << 16;

impl SessionMemory {
    fn get(&self, key: u64) -> Option<&str> {
        self.newer
            .get(&key)
            .or_else(|| self.older.get(&key))
            .map(String::as_str)
    }

    fn put(&mut self, key: u64, url: &str) {
        if self.newer.get(&key).is_some_and(|u| u == url) {
            return;
        }
        if self.newer.len() >= REMEMBERED_SESSIONS && !self.newer.contains_key(&key) {
            self.older = std::mem::take(&mut self.newer);
        }
        self.newer.insert(key, url.to_string());
    }
}

/// The most requests under way a server may hold and still take a session's request: the load
/// factor times the average over `servers` (counting the request), and at least 2, so that
/// below any real load a session stays on its server.
pub(crate) fn session_cap(in_flight: usize, servers: usize) -> usize {
    let fair = SESSION_LOAD_FACTOR * (in_flight as f64 + 1.0) / servers.max(1) as f64;
    (fair.ceil() as usize).max(2)
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

    fn servers<'a>(urls: &'a [String], loads: &[usize]) -> Vec<ServerLoad<'a>> {
        urls.iter()
            .zip(loads)
            .map(|(url, &load)| ServerLoad { url, load })
            .collect()
    }

    #[test]
    fn each_policy_chooses_among_the_candidates_only() {
        let urls: Vec<String> = (0..4).map(|i| format!("http://h{i}:8000")).collect();
        let s = servers(&urls, &[0, 5, 1, 3]);
        let mut memory = SessionMemory::default();
        // Server 0 is out of rotation: the candidates are the rest, in turn order from 2.
        let candidates = [2, 3, 1];
        let turn = Policy::RoundRobin.choose(&s, &candidates, None, &mut memory);
        assert_eq!(turn, Some((2, Choice::Turn)));
        let least = Policy::LeastLoad.choose(&s, &candidates, Some(7), &mut memory);
        assert_eq!(least, Some((2, Choice::LeastLoad)));
        let keyless = Policy::Session.choose(&s, &candidates, None, &mut memory);
        assert_eq!(keyless, Some((2, Choice::LeastLoad)));
        for key in 0..64u64 {
            let (i, _) = Policy::Session
                .choose(&s, &candidates, Some(key), &mut memory)
                .unwrap();
            assert!(candidates.contains(&i), "key {key} chose {i}");
        }
        for policy in Policy::ALL {
            assert_eq!(policy.choose(&s, &[], Some(1), &mut memory), None);
        }
    }

    #[test]
    fn a_session_whose_first_server_is_out_of_rotation_is_counted_as_moved() {
        let urls: Vec<String> = (0..3).map(|i| format!("http://h{i}:8000")).collect();
        let s = servers(&urls, &[0, 0, 0]);
        let key = session_key(b"\"s\"");
        let mut memory = SessionMemory::default();
        let (home, choice) = Policy::Session
            .choose(&s, &[0, 1, 2], Some(key), &mut memory)
            .unwrap();
        assert_eq!(choice, Choice::Session);
        let others: Vec<usize> = (0..3).filter(|&i| i != home).collect();
        let (moved, choice) = Policy::Session
            .choose(&s, &others, Some(key), &mut memory)
            .unwrap();
        assert_ne!(moved, home);
        assert_eq!(choice, Choice::SessionMoved);
        // It stays where it went, now counted as its home.
        let again = Policy::Session.choose(&s, &[0, 1, 2], Some(key), &mut memory);
        assert_eq!(again, Some((moved, Choice::Session)));
    }

    #[test]
    fn the_session_memory_forgets_a_generation_at_a_time() {
        let mut memory = SessionMemory::default();
        for key in 0..REMEMBERED_SESSIONS as u64 {
            memory.put(key, "http://a");
        }
        memory.put(u64::MAX, "http://b");
        assert_eq!(memory.get(0), Some("http://a"), "the older generation");
        assert_eq!(memory.get(u64::MAX), Some("http://b"));
        for key in 0..REMEMBERED_SESSIONS as u64 {
            memory.put(key + (1 << 32), "http://c");
        }
        assert_eq!(memory.get(0), None, "two generations on, forgotten");
    }
}
