//! The proxy's Prometheus metrics, kept in memory and written as the text exposition format at
//! `GET /metrics`: each declared once ([`DECLARED`]: name, type, help), its samples from one
//! place, written by one writer. Names and labels are the Python data plane's, so dashboards
//! carry over.

use super::policy::Choice;
use super::pool::Side;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use routed_experts::validate::Suspect;

/// Seconds: from a fast merge (a millisecond) to a long generation (ten minutes).
const BUCKETS: [f64; 17] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    300.0, 600.0,
];

/// A phase of a request whose time is observed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The prefill call.
    Prefill = 0,
    /// The decode call (to the end of a stream).
    Decode = 1,
    /// The merge of the two bodies' routing.
    Merge = 2,
    /// The whole request.
    Total = 3,
}

impl Phase {
    /// Every phase, in the order the metrics list them.
    pub const ALL: [Phase; 4] = [Phase::Prefill, Phase::Decode, Phase::Merge, Phase::Total];

    /// Its name in the metrics' `phase` label.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::Merge => "merge",
            Phase::Total => "total",
        }
    }
}

impl From<Side> for Phase {
    fn from(side: Side) -> Self {
        match side {
            Side::Prefill => Phase::Prefill,
            Side::Decode => Phase::Decode,
        }
    }
}

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

/// Every metric of one proxy.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16, &'static str), u64>>,
    phases: Mutex<[Histogram; 4]>,
    merged_bytes: AtomicU64,
    in_flight: AtomicI64,
    connections: AtomicI64,
    rejected: Mutex<BTreeMap<&'static str, u64>>,
    upstream_healthy: Mutex<BTreeMap<(&'static str, String), bool>>,
    upstream_failures: Mutex<BTreeMap<(&'static str, String), u64>>,
    routing_rows: Mutex<BTreeMap<(&'static str, String), Suspect>>,
    picks: Mutex<BTreeMap<(&'static str, String, &'static str), u64>>,
    list_changes: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A number as Python's prometheus client writes it (`1.0`, `0.25`).
fn num(x: f64) -> String {
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{x:.1}")
    } else {
        format!("{x}")
    }
}

impl Metrics {
    /// A request answered: its endpoint, status and the side at fault ("none" for a success).
    pub fn request(&self, endpoint: &str, status: u16, side: &'static str) {
        *lock(&self.requests)
            .entry((endpoint.to_string(), status, side))
            .or_default() += 1;
    }

    /// The time of one phase of a request.
    pub fn observe(&self, phase: Phase, seconds: f64) {
        let mut phases = lock(&self.phases);
        let h = &mut phases[phase as usize];
        for (bound, count) in BUCKETS.iter().zip(h.counts.iter_mut()) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        h.count += 1;
        h.sum += seconds;
    }

    /// Bytes of merged bodies and events sent.
    pub fn merged(&self, bytes: usize) {
        self.merged_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// Completion requests being served: +1 or -1.
    pub fn in_flight(&self, delta: i64) {
        self.in_flight.fetch_add(delta, Ordering::Relaxed);
    }

    /// Client connections open: +1 or -1.
    pub fn connections(&self, delta: i64) {
        self.connections.fetch_add(delta, Ordering::Relaxed);
    }

    /// A request or connection refused before any upstream was called, by reason.
    pub fn rejected(&self, reason: &'static str) {
        *lock(&self.rejected).entry(reason).or_default() += 1;
    }

    /// An upstream entered (`true`) or left the rotation.
    pub fn upstream_healthy(&self, side: Side, url: &str, healthy: bool) {
        lock(&self.upstream_healthy).insert((side.name(), url.to_string()), healthy);
    }

    /// A server picked for a request, and why.
    pub fn picked(&self, side: Side, url: &str, choice: Choice) {
        *lock(&self.picks)
            .entry((side.name(), url.to_string(), choice.name()))
            .or_default() += 1;
    }

    /// A server added to a side's list (`added`) or taken out of it.
    pub fn list_changed(&self, side: Side, url: &str, added: bool) {
        let change = if added { "added" } else { "removed" };
        *lock(&self.list_changes)
            .entry((side.name(), change))
            .or_default() += 1;
        let mut healthy = lock(&self.upstream_healthy);
        if added {
            healthy.insert((side.name(), url.to_string()), true);
        } else {
            // A gauge of a server no longer listed would say it serves.
            healthy.remove(&(side.name(), url.to_string()));
        }
    }

    /// A failed request to an upstream.
    pub fn upstream_failed(&self, side: Side, url: &str) {
        *lock(&self.upstream_failures)
            .entry((side.name(), url.to_string()))
            .or_default() += 1;
    }

    /// Rows sampled from an upstream's routing, and those that look like an engine's fault.
    pub fn routing_rows(&self, side: Side, url: &str, seen: Suspect) {
        if seen.checked > 0 {
            lock(&self.routing_rows)
                .entry((side.name(), url.to_string()))
                .or_default()
                .merge(seen);
        }
    }

    /// The text exposition format: every metric of [`DECLARED`], in its order, each with its
    /// help and type, then its samples (labels in name order), then the process's own.
    pub fn render(&self) -> String {
        let mut o = String::with_capacity(4096);
        for d in DECLARED {
            let _ = writeln!(
                o,
                "# HELP {} {}\n# TYPE {} {}",
                d.name, d.help, d.name, d.kind
            );
            let mut samples = Samples(Vec::new());
            (d.samples)(self, &mut samples);
            for (suffix, labels, value) in samples.0 {
                let _ = write!(o, "{}{suffix}", d.name);
                if !labels.is_empty() {
                    let shown: Vec<String> =
                        labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
                    let _ = write!(o, "{{{}}}", shown.join(","));
                }
                let _ = writeln!(o, " {}", num(value));
            }
        }
        super::process::render(&mut o);
        o
    }
}

/// A sample of a metric: its name's suffix (a histogram's `_bucket`, `_count`, `_sum`), its
/// labels (sorted by name), its value.
type Sample = (&'static str, Vec<(&'static str, String)>, f64);

/// The samples of one metric, as its declaration's `samples` writes them.
pub struct Samples(Vec<Sample>);

impl Samples {
    fn push(&mut self, suffix: &'static str, mut labels: Vec<(&'static str, String)>, v: f64) {
        labels.sort_by_key(|(k, _)| *k);
        self.0.push((suffix, labels, v));
    }
}

fn count(n: u64) -> f64 {
    n as f64
}

fn side_url(side: &str, url: &str) -> Vec<(&'static str, String)> {
    vec![("side", side.to_string()), ("upstream", url.to_string())]
}

/// A metric `/metrics` exports: its name, type and help.
pub struct Declared {
    /// The metric's name.
    pub name: &'static str,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// What it counts.
    pub help: &'static str,
    /// Its samples, from the metrics' state.
    pub samples: fn(&Metrics, &mut Samples),
}

/// Every metric of the proxy, declared once, in the order `/metrics` lists them
/// (docs/proxy.md's list is checked against it).
pub const DECLARED: &[Declared] = &[
    Declared {
        name: "routed_experts_proxy_build_info",
        kind: "gauge",
        help: "The proxy's version (the value is always 1)",
        samples: |_, out| {
            out.push(
                "",
                vec![("version", env!("CARGO_PKG_VERSION").to_string())],
                1.0,
            );
        },
    },
    Declared {
        name: "routed_experts_proxy_requests_total",
        kind: "counter",
        help: "Requests answered, by endpoint (\"other\": a path the proxy does not serve, or \
               the wrong method), HTTP status and the side at fault (none, client, prefill, \
               decode, merge, proxy); 499: the client left first",
        samples: |m, out| {
            for ((endpoint, status, side), n) in lock(&m.requests).iter() {
                let labels = vec![
                    ("endpoint", endpoint.clone()),
                    ("side", side.to_string()),
                    ("status", status.to_string()),
                ];
                out.push("", labels, count(*n));
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_phase_seconds",
        kind: "histogram",
        help: "Time of each phase of a request: prefill call, decode call (to the end of a \
               stream), merge, and the whole request",
        samples: |m, out| {
            let phases = lock(&m.phases);
            for (phase, h) in Phase::ALL.iter().map(|p| p.name()).zip(phases.iter()) {
                let at = |le: String| vec![("le", le), ("phase", phase.to_string())];
                for (bound, n) in BUCKETS.iter().zip(h.counts.iter()) {
                    out.push("_bucket", at(num(*bound)), count(*n));
                }
                out.push("_bucket", at("+Inf".into()), count(h.count));
                out.push("_count", vec![("phase", phase.to_string())], count(h.count));
                out.push("_sum", vec![("phase", phase.to_string())], h.sum);
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_merged_bytes_total",
        kind: "counter",
        help: "Bytes of merged response bodies and merged stream events sent to clients",
        samples: |m, out| {
            out.push("", vec![], count(m.merged_bytes.load(Ordering::Relaxed)));
        },
    },
    Declared {
        name: "routed_experts_proxy_requests_in_flight",
        kind: "gauge",
        help: "Completion requests being served",
        samples: |m, out| {
            out.push("", vec![], m.in_flight.load(Ordering::Relaxed) as f64);
        },
    },
    Declared {
        name: "routed_experts_proxy_connections",
        kind: "gauge",
        help: "Client connections open",
        samples: |m, out| {
            out.push("", vec![], m.connections.load(Ordering::Relaxed) as f64);
        },
    },
    Declared {
        name: "routed_experts_proxy_rejected_total",
        kind: "counter",
        help: "Requests or connections refused before any upstream was called, by reason \
               (in_flight, no_upstream, body_timeout, buffered_bytes, connections, \
               header_timeout)",
        samples: |m, out| {
            for (reason, n) in lock(&m.rejected).iter() {
                out.push("", vec![("reason", reason.to_string())], count(*n));
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_upstream_healthy",
        kind: "gauge",
        help: "1 while an upstream is in rotation, 0 while it is ejected by passive health \
               checks",
        samples: |m, out| {
            for ((side, url), up) in lock(&m.upstream_healthy).iter() {
                out.push("", side_url(side, url), f64::from(u8::from(*up)));
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_upstream_picks_total",
        kind: "counter",
        help: "Requests sent to each upstream, by why it was picked (turn, least_load, \
               session: the server the session ranks first, session_moved: another, as its \
               first was out of rotation or over the load bound, trial: a trial after \
               ejection)",
        samples: |m, out| {
            for ((side, url, choice), n) in lock(&m.picks).iter() {
                let mut labels = side_url(side, url);
                labels.push(("choice", choice.to_string()));
                out.push("", labels, count(*n));
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_upstream_list_changes_total",
        kind: "counter",
        help: "Servers added to or removed from a side's list while running (admin endpoint, \
               SIGHUP)",
        samples: |m, out| {
            for ((side, change), n) in lock(&m.list_changes).iter() {
                let labels = vec![("change", change.to_string()), ("side", side.to_string())];
                out.push("", labels, count(*n));
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_routing_rows_checked_total",
        kind: "counter",
        help: "Routing rows sampled from each upstream's replies (up to 64 a value; decode's \
               from the end of prefill's rows on) for the marks of a broken engine",
        samples: |m, out| {
            for ((side, url), seen) in lock(&m.routing_rows).iter() {
                out.push("", side_url(side, url), count(seen.checked));
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_suspect_routing_rows_total",
        kind: "counter",
        help: "Of the rows sampled, those zero in every id (kind zero) or with an expert twice \
               in one layer's top_k (kind duplicate): routing no router made",
        samples: |m, out| {
            for ((side, url), seen) in lock(&m.routing_rows).iter() {
                for (kind, n) in [("duplicate", seen.duplicate_rows), ("zero", seen.zero_rows)] {
                    let mut labels = side_url(side, url);
                    labels.push(("kind", kind.to_string()));
                    out.push("", labels, count(n));
                }
            }
        },
    },
    Declared {
        name: "routed_experts_proxy_upstream_failures_total",
        kind: "counter",
        help: "Failed requests to an upstream (no connection, timeout, broken reply, 5xx)",
        samples: |m, out| {
            for ((side, url), n) in lock(&m.upstream_failures).iter() {
                out.push("", side_url(side, url), count(*n));
            }
        },
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_gauges() {
        let m = Metrics::default();
        m.request("/v1/completions", 200, "none");
        m.request("/v1/completions", 200, "none");
        m.observe(Phase::Merge, 0.003);
        m.rejected("body_timeout");
        m.in_flight(1);
        m.in_flight(-1);
        m.upstream_healthy(Side::Decode, "http://d:1", false);
        let text = m.render();
        assert!(text.contains(
            "routed_experts_proxy_requests_total{endpoint=\"/v1/completions\",side=\"none\",\
             status=\"200\"} 2.0"
        ));
        assert!(text.contains(
            "routed_experts_proxy_phase_seconds_bucket{le=\"0.0025\",phase=\"merge\"} 0.0"
        ));
        assert!(text.contains(
            "routed_experts_proxy_phase_seconds_bucket{le=\"0.005\",phase=\"merge\"} 1.0"
        ));
        assert!(text.contains("routed_experts_proxy_phase_seconds_count{phase=\"total\"} 0.0"));
        assert!(text.contains("routed_experts_proxy_rejected_total{reason=\"body_timeout\"} 1.0"));
        assert!(text.contains("routed_experts_proxy_requests_in_flight 0.0"));
        assert!(text.contains("upstream=\"http://d:1\"} 0.0"));
    }

    #[test]
    fn every_declared_metric_is_rendered_once_and_documented() {
        let text = Metrics::default().render();
        let manual = include_str!("../../../docs/proxy.md");
        for d in DECLARED {
            assert_eq!(
                text.matches(&format!("# TYPE {} ", d.name)).count(),
                1,
                "{}",
                d.name
            );
            assert!(
                manual.contains(d.name),
                "docs/proxy.md does not list {}",
                d.name
            );
        }
        let mut names: Vec<_> = DECLARED.iter().map(|d| d.name).collect();
        names.dedup();
        assert_eq!(names.len(), DECLARED.len());
    }
}
