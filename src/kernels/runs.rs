//! The long base64 runs of a body, found while it arrives.
//!
//! A proxy receives an upstream body in pieces and joins them into one buffer: each piece is in
//! the core's cache right after it is copied there. Scanning it then for base64 characters costs
//! a fraction of what the walk's scan of the same megabytes costs later, once the whole body has
//! left the cache (a routing string of vLLM's `.npy` text is 4 MB at 8k tokens of
//! Qwen3-30B-A3B). [`read_prefill_scanned`](crate::body::read_prefill_scanned) then takes each string
//! whose run is known without scanning it again.

use std::ops::Range;

use super::strscan::{base64_run, trailing_base64};

/// The runs of base64 characters (`A-Z a-z 0-9 + /`), [`MIN_RUN`](Self::MIN_RUN) bytes or
/// longer, that start at the body's start or after the last other byte of one of its pieces:
/// what a large routing string sent in pieces is. Other runs are not kept (the walk scans those
/// itself, as it would without this).
///
/// Build it with [`extend`](Self::extend) after each piece is appended to the body's buffer; it
/// holds positions, not bytes, so it is only true of that buffer.
#[derive(Debug, Clone, Default)]
pub struct Base64Runs {
    runs: Vec<Range<usize>>,
    /// Where the run reaching the end of what was scanned starts (the end itself when the last
    /// byte scanned is not base64).
    open: usize,
    scanned: usize,
}

impl Base64Runs {
    /// Runs shorter than this are not kept: they cost the walk little to scan. (Eight bytes
    /// under the fuzzer, whose inputs are small.)
    pub const MIN_RUN: usize = if cfg!(fuzzing) { 8 } else { 4096 };

    /// Nothing scanned yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scan what `body` gained since the last call (`body[self.scanned()..]`). `body` must be
    /// the bytes scanned before with more appended: a shorter one resets this to nothing
    /// known, so a mistaken call costs the walk its scan, never a wrong run.
    pub fn extend(&mut self, body: &[u8]) {
        let Some(new) = body.get(self.scanned..) else {
            *self = Self::new();
            return;
        };
        let first = base64_run(new);
        if first < new.len() {
            let end = self.scanned + first;
            if end - self.open >= Self::MIN_RUN {
                self.runs.push(self.open..end);
            }
            self.open = body.len() - trailing_base64(&new[first + 1..]);
        }
        self.scanned = body.len();
    }

    /// How many bytes of the body have been scanned.
    pub fn scanned(&self) -> usize {
        self.scanned
    }

    /// Where the base64 run that starts at `start` ends (the index of the first byte after it
    /// that is not base64), when it is one of the runs kept.
    pub fn run_from(&self, start: usize) -> Option<usize> {
        let i = self.runs.partition_point(|r| r.start < start);
        self.runs.get(i).filter(|r| r.start == start).map(|r| r.end)
    }

    /// The runs kept, in body order.
    pub fn runs(&self) -> &[Range<usize>] {
        &self.runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::strscan::is_base64;

    /// Every maximal base64 run of `body` at least `MIN_RUN` long.
    fn all_long_runs(body: &[u8]) -> Vec<Range<usize>> {
        let mut runs = Vec::new();
        let mut at = 0;
        while at < body.len() {
            if !is_base64(body[at]) {
                at += 1;
                continue;
            }
            let end = at
                + body[at..]
                    .iter()
                    .position(|&c| !is_base64(c))
                    .unwrap_or(body.len() - at);
            if end - at >= Base64Runs::MIN_RUN {
                runs.push(at..end);
            }
            at = end;
        }
        runs
    }

    #[test]
    fn the_runs_kept_are_exactly_the_long_runs_that_cross_a_piece_boundary() {
        let mut next = crate::test_rng::xorshift(7);
        let mut rand = move |n: usize| (next() % n as u64) as usize;
        let mut kept = 0;
        for round in 0..300 {
            // Runs of every length around MIN_RUN, separated by JSON punctuation or bytes
            // outside the alphabet, sent in pieces of any size.
            let mut body = Vec::new();
            for _ in 0..1 + rand(6) {
                let len = [0, 1, 100, 4095, 4096, 4097, 9000, 20000][rand(8)];
                body.extend((0..len).map(|i| b"Az09+/xQ"[(i + round) % 8]));
                body.extend_from_slice(
                    [&b"\""[..], b"\",\"", b"=", b"\xc3\xa9", b"\n", b"\\"][rand(6)],
                );
            }
            let mut runs = Base64Runs::new();
            let mut cuts = vec![0];
            let mut joined = Vec::new();
            while joined.len() < body.len() {
                let n = (1 + rand(12000)).min(body.len() - joined.len());
                joined.extend_from_slice(&body[joined.len()..joined.len() + n]);
                runs.extend(&joined);
                cuts.push(joined.len());
            }
            assert_eq!(runs.scanned(), body.len());
            let long = all_long_runs(&body);
            let crossing: Vec<_> = long
                .iter()
                .filter(|r| cuts.iter().any(|&c| r.start < c && c < r.end))
                .collect();
            // Every run kept is a true maximal run, and every long run that crosses a cut is
            // kept (the bodies here end with a byte outside the alphabet, so none stays open).
            kept += runs.runs().len();
            for r in runs.runs() {
                assert!(long.contains(r), "{r:?} kept, not a long run");
                assert_eq!(runs.run_from(r.start), Some(r.end));
                assert_eq!(base64_run(&body[r.start..]), r.len());
                assert!(r.start == 0 || !is_base64(body[r.start - 1]));
            }
            for &r in &crossing {
                assert!(
                    runs.runs().contains(r),
                    "{r:?} crosses a cut and was not kept"
                );
            }
        }
        assert!(kept > 100, "only {kept} runs kept in all the rounds");
    }

    #[test]
    fn a_body_that_is_not_the_one_scanned_resets_what_is_known() {
        let mut body = b"{\"x\":\"".to_vec();
        body.extend(std::iter::repeat_n(b'A', 5000));
        let mut runs = Base64Runs::new();
        runs.extend(&body);
        body.extend_from_slice(b"\"}");
        runs.extend(&body);
        assert_eq!(runs.runs(), std::slice::from_ref(&(6..5006)));
        runs.extend(&body[..10]);
        assert_eq!((runs.runs(), runs.scanned()), (&[][..], 0));
        assert_eq!(runs.run_from(6), None);
    }

    #[test]
    fn a_prefill_read_with_its_runs_is_the_same_read_as_without() {
        let mut next = crate::test_rng::xorshift(11);
        let mut rand = move |n: usize| (next() % n as u64) as usize;
        let text = |len: usize, k: usize| -> Vec<u8> {
            (0..len).map(|i| b"QUJD+/9z"[(i * 3 + k) % 8]).collect()
        };
        let mut taken = 0;
        for round in 0..400 {
            let len = [10, 4095, 4096, 6000, 30000][rand(5)];
            let mut routing = text(len, round);
            // Flaws the walk must see whether or not the run is known: padding, a byte outside
            // the alphabet, an escape, a quote early, padding in the middle.
            match rand(7) {
                0 => routing.extend_from_slice(b"=="),
                1 => routing[len / 2] = b'=',
                2 => routing[len - 1] = b'-',
                3 => routing.extend_from_slice(b"\\u0041"),
                4 => routing.extend_from_slice(b"==="),
                _ => {}
            }
            let head = br#"{"id":"x","choices":[{"index":0,"text":"a","routed_experts":""#;
            let mut body = head.to_vec();
            body.extend_from_slice(&routing);
            body.extend_from_slice(
                br#""}],"kv_transfer_params":{"k":1},"usage":{"prompt_tokens":3}}"#,
            );
            if rand(4) == 0 {
                body.truncate(body.len() - 1 - rand(40)); // cut short
            }
            let mut runs = Base64Runs::new();
            let mut joined = Vec::new();
            while joined.len() < body.len() {
                let n = (1 + rand(9000)).min(body.len() - joined.len());
                joined.extend_from_slice(&body[joined.len()..joined.len() + n]);
                runs.extend(&joined);
            }
            let plain = format!("{:?}", crate::body::read_prefill(&body));
            let scanned = format!(
                "{:?}",
                crate::body::read_prefill_scanned(&body, Some(&runs))
            );
            assert_eq!(plain, scanned, "round {round}");
            taken += usize::from(runs.run_from(head.len()).is_some());
        }
        assert!(
            taken > 100,
            "the routing string's run was known in only {taken} rounds"
        );
    }
}
