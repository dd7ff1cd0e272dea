//! Packing samples into one batch for the trainer (format.md §6): one dtype, each sample's rows
//! where its tokens are, cumulative sequence lengths, a mask of the rows that carry routing,
//! optional padding of each sample and of the batch.

use crate::error::{Error, ErrorKind, Result};
use crate::payload::dtype::{DType, Element};
use crate::payload::merge::check_same_rows;
use crate::payload::{Payload, Shape};
use crate::trainer::shard::Plan;

use std::ops::Range;

/// How samples are laid out in the batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PackOptions {
    /// Each sample's token count: its rows are positions `0..n`, the payload's rows at their
    /// positions; rows it has no routing for (before its start, after its stop: vLLM's last
    /// sampled token has none) are filled and masked. Routing past `n` is an error. `None`:
    /// each sample is positions `0..stop` of its payload, its rows at their positions (a delta's
    /// rows before its start filled and masked, never shifted to position 0).
    pub num_tokens: Option<Vec<usize>>,
    /// Pad every sample at its end to a multiple of this many rows (counted in `cu_seqlens`:
    /// what context parallelism needs).
    pub pad_each_to_multiple: Option<usize>,
    /// Pad the batch at its end to a multiple of this many rows (not counted in `cu_seqlens`).
    pub pad_to_multiple: Option<usize>,
}

/// Where each sample goes: the batch's rows, `cu_seqlens` (`[0, n0, n0+n1, ...]`, padded
/// sample lengths), and the batch row each payload's first row lands on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Rows of the batch, trailing padding included.
    pub rows: usize,
    /// Cumulative sample lengths.
    pub cu_seqlens: Vec<usize>,
    places: Vec<usize>,
}

fn multiple_of(name: &str, n: usize, m: Option<usize>) -> Result<usize> {
    match m {
        None => Ok(n),
        Some(0) => Err(Error::field(name, "a positive integer", 0)),
        Some(m) => n.div_ceil(m).checked_mul(m).ok_or_else(|| {
            Error::malformed(format!("{n} rows padded to a multiple of {m} overflow"))
        }),
    }
}

/// The layout of `samples` under `opts`, the packed shape (in `dtype`) held to `max_bytes`
/// before anything is allocated.
pub fn layout(
    samples: &[&Payload],
    opts: &PackOptions,
    dtype: DType,
    max_bytes: usize,
) -> Result<Layout> {
    let whole: Vec<&[&Payload]> = samples.iter().map(std::slice::from_ref).collect();
    layout_parts(&whole, opts, dtype, max_bytes)
}

/// Where a sample made of parts (payloads of consecutive positions, such as a group's prompt
/// rows, shared by its choices, then one choice's own rows) starts, and how many rows its parts
/// hold; parts that do not follow each other are refused, naming the sample and the part.
fn parts_span(i: usize, parts: &[&Payload], first: &Payload) -> Result<(u64, usize)> {
    let Some(head) = parts.first() else {
        return Err(Error::field(
            "samples",
            "samples of at least one part",
            format!("sample {i} with none"),
        ));
    };
    let mut rows = 0usize;
    for (k, part) in parts.iter().enumerate() {
        let name = format!("sample {i}, part {k}");
        check_same_rows(first.shape(), part.shape(), "sample 0", &name)?;
        if k > 0 && part.start() != parts[k - 1].stop() {
            let (stop, start) = (parts[k - 1].stop(), part.start());
            let message = format!(
                "{name} starts at position {start}, but part {} stops at {stop}: a sample's \
                 parts are consecutive positions",
                k - 1
            );
            return Err(if start > stop {
                Error::new(ErrorKind::Gap { stop, start }, message)
            } else {
                Error::malformed(message)
            });
        }
        rows = rows
            .checked_add(part.num_tokens())
            .ok_or_else(|| Error::malformed(format!("sample {i}: more than 2**64 rows")))?;
    }
    Ok((head.start(), rows))
}

/// [`layout`] of samples each made of parts of consecutive positions, which may be shared
/// between samples (a group's prompt rows): each is laid out as the one payload its parts
/// join to, without joining them.
pub fn layout_parts(
    samples: &[&[&Payload]],
    opts: &PackOptions,
    dtype: DType,
    max_bytes: usize,
) -> Result<Layout> {
    let Some(first) = samples.iter().find_map(|s| s.first()) else {
        let got = match samples.len() {
            0 => "an empty list".to_string(),
            n => format!("{n} samples of no parts"),
        };
        return Err(Error::field("samples", "at least one sample", got));
    };
    if let Some(n) = &opts.num_tokens {
        if n.len() != samples.len() {
            return Err(Error::field(
                "num_tokens",
                format!("one count per sample ({})", samples.len()),
                n.len(),
            ));
        }
    }
    let mut cu = Vec::with_capacity(samples.len() + 1);
    let mut places = Vec::with_capacity(samples.len());
    let mut rows = 0usize;
    cu.push(rows);
    for (i, parts) in samples.iter().enumerate() {
        let (s_start, s_rows) = parts_span(i, parts, first)?;
        let (len, offset) = match &opts.num_tokens {
            None => {
                let start = usize::try_from(s_start).map_err(|_| {
                    Error::malformed(format!("sample {i}: a start of {s_start} positions"))
                })?;
                let stop = start
                    .checked_add(s_rows)
                    .ok_or_else(|| Error::malformed(format!("sample {i}: positions past 2**64")))?;
                (stop, start)
            }
            Some(counts) => {
                let n = counts[i];
                let start = usize::try_from(s_start).unwrap_or(usize::MAX);
                let stop = start.saturating_add(s_rows);
                if stop > n {
                    return Err(Error::malformed(format!(
                        "sample {i}: routing covers positions {start}..{stop}, past its \
                         num_tokens of {n} (routing covers at most every token)"
                    )));
                }
                (n, start)
            }
        };
        let len = multiple_of("pad_each_to_multiple", len, opts.pad_each_to_multiple)?;
        places.push(rows + offset);
        rows = rows
            .checked_add(len)
            .ok_or_else(|| Error::malformed("pack: more than 2**64 rows in all"))?;
        cu.push(rows);
    }
    let samples_rows = rows;
    let total = multiple_of("pad_to_multiple", rows, opts.pad_to_multiple)?;
    let shape = Shape {
        tokens: total,
        ..first.shape()
    };
    crate::limits::check_shape(shape, dtype, max_bytes).map_err(|e| {
        let mut what = format!("pack of {samples_rows} rows");
        if let Some(m) = opts.pad_each_to_multiple {
            what += &format!(" with pad_each_to_multiple={m}");
        }
        if let Some(m) = opts.pad_to_multiple {
            what += &format!(" with pad_to_multiple={m}");
        }
        e.context(what)
    })?;
    Ok(Layout {
        rows: total,
        cu_seqlens: cu,
        places,
    })
}

/// Write every sample's values, converted to `D`, where `layout` puts them in `dst` (zeros
/// everywhere else, as in a fresh array), and mark in `mask` (one entry per batch row, all
/// false to begin with) the rows that carry routing. A row marked missing (all `-1`) is written
/// as zeros and left unmarked: no `-1` reaches the batch; a `-1` beside real ids is an error.
pub fn pack_into<D: Element>(
    samples: &[&Payload],
    layout: &Layout,
    dst: &mut [D],
    mask: Option<&mut [bool]>,
) -> Result<()> {
    let whole: Vec<&[&Payload]> = samples.iter().map(std::slice::from_ref).collect();
    pack_parts_into(&whole, layout, dst, mask)
}

/// [`pack_into`] of samples made of parts (as [`layout_parts`] lays them out): each part's
/// rows written where its positions fall in its sample, a part shared by several samples
/// written once for each.
pub fn pack_parts_into<D: Element>(
    samples: &[&[&Payload]],
    layout: &Layout,
    dst: &mut [D],
    mut mask: Option<&mut [bool]>,
) -> Result<()> {
    let Some(first) = samples.iter().find_map(|s| s.first()) else {
        return Ok(());
    };
    let row = first.num_layers() * first.top_k();
    // A Rust caller may pass buffers or samples other than the layout's: refused, never a
    // slice out of bounds.
    check_buffers(
        samples.len(),
        layout,
        "layout",
        (layout.rows, row),
        dst.len(),
        mask.as_deref(),
    )?;
    for (i, (parts, &place)) in samples.iter().zip(&layout.places).enumerate() {
        let (s_start, _) = parts_span(i, parts, first)?;
        for s in parts.iter() {
            // Within u64: `parts_span` found the parts consecutive from `s_start`.
            let at = place + (s.start() - s_start) as usize;
            write_part(i, s, at, row, dst, mask.as_deref_mut())?;
        }
    }
    Ok(())
}

/// A write's buffers and samples held to what it writes (a Rust caller may pass others:
/// refused, never a slice out of bounds): `dst` of `rows x width` values, `mask` of one entry
/// per row (`of`: "layout" or "plan", whose rows they are), the samples the layout was made for.
fn check_buffers(
    samples: usize,
    layout: &Layout,
    of: &str,
    (rows, width): (usize, usize),
    dst: usize,
    mask: Option<&[bool]>,
) -> Result<()> {
    if rows.checked_mul(width) != Some(dst) {
        let expected = format!("the {of}'s {rows} rows of {width} values");
        return Err(Error::field("dst", expected, format!("{dst} values")));
    }
    if let Some(m) = mask.filter(|m| m.len() != rows) {
        let expected = format!("one entry per row of the {of} ({rows})");
        return Err(Error::field(
            "mask",
            expected,
            format!("{} entries", m.len()),
        ));
    }
    if samples != layout.places.len() {
        let expected = format!(
            "the {} samples the layout was made for",
            layout.places.len()
        );
        return Err(Error::field("samples", expected, samples));
    }
    Ok(())
}

/// One part's rows (of sample `i`) at batch row `at`, converted; its rows that carry routing
/// marked in `mask`.
fn write_part<D: Element>(
    i: usize,
    s: &Payload,
    at: usize,
    row: usize,
    dst: &mut [D],
    mask: Option<&mut [bool]>,
) -> Result<()> {
    let n = s.num_tokens();
    let end = at.checked_add(n).and_then(|e| e.checked_mul(row));
    if s.num_layers() * s.top_k() != row || end.is_none_or(|e| e > dst.len()) {
        return Err(Error::field(
            "samples",
            "the samples the layout was made for",
            format!("sample {i} of {} that does not fit it", s.shape()),
        ));
    }
    let layers = 0..s.num_layers();
    let out = &mut dst[at * row..(at + n) * row];
    write_block(i, s, 0..n, layers, out, mask.map(|m| &mut m[at..at + n]))
}

/// Rows `rows` of part `s` (of sample `i`; its own row numbers), layers `layers`, converted
/// into `dst` (one slot per value kept); each row's entry of `mask` (one per row written) says
/// whether it carries routing. A row marked missing (all -1, in every layer) is written as
/// zeros, whatever the dtype; a -1 beside real ids is an error.
fn write_block<D: Element>(
    i: usize,
    s: &Payload,
    rows: Range<usize>,
    layers: Range<usize>,
    dst: &mut [D],
    mut mask: Option<&mut [bool]>,
) -> Result<()> {
    let signed = matches!(s.dtype(), DType::I8 | DType::I16 | DType::I32 | DType::I64);
    let in_sample = |e: Error| e.context(format!("sample {i}"));
    if !signed {
        // No row can be marked missing: one conversion for the whole block.
        s.write_block_as(rows.start, rows.end, layers, dst)
            .map_err(in_sample)?;
        if let Some(m) = mask {
            m.fill(true);
        }
        return Ok(());
    }
    let (row, width) = (s.num_layers() * s.top_k(), layers.len() * s.top_k());
    for (t, r) in rows.enumerate() {
        let out = &mut dst[t * width..(t + 1) * width];
        let real = match s.sentinels(r) {
            (0, _) => {
                s.write_block_as(r, r + 1, layers.clone(), out)
                    .map_err(in_sample)?;
                true
            }
            (count, _) if count == row => {
                out.fill(D::zeroed());
                false
            }
            (_, at) => {
                let (position, layer) = (s.start() + r as u64, at / s.top_k().max(1));
                return Err(Error::new(
                    ErrorKind::Id { position, layer },
                    format!(
                        "sample {i}: position {position} has -1 in layer {layer} beside real \
                         ids (a missing row is -1 throughout)"
                    ),
                ));
            }
        };
        if let Some(m) = mask.as_deref_mut() {
            m[t] = real;
        }
    }
    Ok(())
}

/// One rank's share of the batch `layout` lays out, written without the batch: what
/// [`crate::shard::gather`] would take, by `plan`, from the batch [`pack_parts_into`] writes.
/// `plan` comes from [`crate::shard::plan`] over `layout.cu_seqlens`, `layout.rows` and the
/// samples' layers; `dst` holds the plan's rows x its layers x top_k, `mask` one entry per
/// plan row. Every value of both is written (zeros and false where no routing is), so a
/// buffer may be reused from step to step.
pub fn pack_share_into<D: Element>(
    samples: &[&[&Payload]],
    layout: &Layout,
    plan: &Plan,
    dst: &mut [D],
    mut mask: Option<&mut [bool]>,
) -> Result<()> {
    let Some(first) = samples.iter().find_map(|s| s.first()) else {
        return Err(Error::field("samples", "at least one sample", "none"));
    };
    let (num_layers, top_k) = (first.num_layers(), first.top_k());
    if plan.layers.start >= plan.layers.end || plan.layers.end > num_layers {
        let got = format!("layers {}..{}", plan.layers.start, plan.layers.end);
        return Err(Error::field(
            "plan",
            format!("layers within 0..{num_layers}"),
            got,
        ));
    }
    if let Some(run) = plan.rows.iter().find(|r| r.end > layout.rows) {
        let (rows, got) = (layout.rows, format!("rows {}..{}", run.start, run.end));
        return Err(Error::field(
            "plan",
            format!("rows within the layout's {rows}"),
            got,
        ));
    }
    let width = plan.layers.len() * top_k;
    let rows = plan.num_rows();
    check_buffers(
        samples.len(),
        layout,
        "plan",
        (rows, width),
        dst.len(),
        mask.as_deref(),
    )?;
    // Every part's first batch row: ascending, the parts disjoint (samples follow each other,
    // a sample's parts are consecutive positions).
    let mut spans: Vec<(usize, usize, &Payload)> = Vec::new();
    for (i, (parts, &place)) in samples.iter().zip(&layout.places).enumerate() {
        let (s_start, _) = parts_span(i, parts, first)?;
        for &p in parts.iter() {
            // Within u64: `parts_span` found the parts consecutive from `s_start`.
            let at = place + (p.start() - s_start) as usize;
            if at
                .checked_add(p.num_tokens())
                .is_none_or(|e| e > layout.rows)
            {
                return Err(Error::field(
                    "samples",
                    "the samples the layout was made for",
                    format!("sample {i} of {} that does not fit it", p.shape()),
                ));
            }
            spans.push((at, i, p));
        }
    }
    let mut out = 0usize; // the share's row the run starts at
    let blank = |dst: &mut [D], mask: &mut Option<&mut [bool]>, from: usize, to: usize| {
        dst[from * width..to * width].fill(D::zeroed());
        if let Some(m) = mask.as_deref_mut() {
            m[from..to].fill(false);
        }
    };
    for run in &plan.rows {
        let mut filled = run.start;
        let mut k = spans.partition_point(|&(at, _, p)| at + p.num_tokens() <= run.start);
        while let Some(&(at, i, p)) = spans.get(k).filter(|s| s.0 < run.end) {
            let (a, b) = (at.max(run.start), (at + p.num_tokens()).min(run.end));
            if a < b {
                let (from, to) = (out + a - run.start, out + b - run.start);
                blank(dst, &mut mask, out + filled - run.start, from);
                let m = mask.as_deref_mut().map(|m| &mut m[from..to]);
                let block = &mut dst[from * width..to * width];
                write_block(i, p, a - at..b - at, plan.layers.clone(), block, m)?;
                filled = b;
            }
            k += 1;
        }
        blank(dst, &mut mask, out + filled - run.start, out + run.len());
        out += run.len();
    }
    Ok(())
}

#[cfg(test)]
mod tests;
