//! The standard process metrics an operator's dashboards expect beside the proxy's own
//! (`process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds`), read
//! from `/proc/self` when `/metrics` is asked for. Elsewhere than Linux they are left out.

use std::fmt::Write as _;

/// The process's metrics in the text exposition format (nothing where `/proc` is missing).
pub fn render(o: &mut String) {
    let Some(p) = read() else {
        return;
    };
    let mut gauge = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(
            o,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    };
    gauge(
        "process_resident_memory_bytes",
        "gauge",
        "Resident memory size in bytes",
        p.resident_bytes as f64,
    );
    gauge(
        "process_cpu_seconds_total",
        "counter",
        "User and system CPU time spent, in seconds",
        p.cpu_seconds,
    );
    gauge(
        "process_open_fds",
        "gauge",
        "Open file descriptors",
        p.open_fds as f64,
    );
}

struct Process {
    resident_bytes: u64,
    cpu_seconds: f64,
    open_fds: usize,
}

#[cfg(target_os = "linux")]
fn read() -> Option<Process> {
    // SAFETY: sysconf only reads a configuration value.
    let (page, ticks) = unsafe {
        (
            libc::sysconf(libc::_SC_PAGESIZE),
            libc::sysconf(libc::_SC_CLK_TCK),
        )
    };
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let resident_pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces and parentheses): utime and stime
    // are the 12th and 13th of them.
    let after_name = &stat[stat.rfind(')')? + 2..];
    let mut fields = after_name.split_whitespace().skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
    Some(Process {
        resident_bytes: resident_pages * u64::try_from(page).ok()?,
        cpu_seconds: (utime + stime) / ticks.max(1) as f64,
        open_fds,
    })
}

#[cfg(not(target_os = "linux"))]
fn read() -> Option<Process> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #[test]
    fn the_process_reads_itself() {
        let p = super::read().expect("/proc/self");
        assert!(p.resident_bytes > 1 << 20, "{}", p.resident_bytes);
        assert!(p.open_fds >= 3);
        let mut o = String::new();
        super::render(&mut o);
        assert!(o.contains("process_cpu_seconds_total "), "{o}");
    }
}
