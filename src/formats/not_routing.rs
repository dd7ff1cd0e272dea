//! What a value that is not routing looks like, for the error that refuses it (format.md §3.2):
//! a user who passed a PNG, a password file or a saved event stream is told that, not asked for
//! SGLang's shape.

/// How many leading bytes an error quotes.
const QUOTE_BYTES: usize = 40;

/// Binary files users have been seen to pass, by their magic bytes.
const MAGIC: &[(&[u8], &str)] = &[
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"\x1f\x8b", "gzip-compressed data (decompress it first)"),
    (b"PK\x03\x04", "a zip archive"),
    (
        b"\x28\xb5\x2f\xfd",
        "zstd-compressed data (decompress it first)",
    ),
    (
        b"\x93NUMPY",
        "a raw .npy file (vLLM sends it base64-encoded; pass np.load's array to from_array)",
    ),
];

/// A short phrase for what `text` is, given that it is no routing format.
pub fn describe(text: &[u8]) -> String {
    let trimmed = text.trim_ascii();
    if trimmed.is_empty() {
        return "only whitespace".to_string();
    }
    if let Some((_, what)) = MAGIC.iter().find(|(magic, _)| trimmed.starts_with(magic)) {
        return (*what).to_string();
    }
    if trimmed.len() > 1 && trimmed[0] == 0x80 && (2..=5).contains(&trimmed[1]) {
        return "a Python pickle (unpickle it in the code that made it and pass the array)"
            .to_string();
    }
    let Ok(s) = std::str::from_utf8(trimmed) else {
        return binary(trimmed);
    };
    if s.chars().any(|c| c.is_control() && !c.is_whitespace()) {
        return binary(trimmed);
    }
    let first_line = s.lines().next().unwrap_or("");
    let sse_field = ["data:", "event:", "id:", "retry:", ":"];
    if sse_field.iter().any(|f| first_line.starts_with(f)) {
        return "a server-sent event stream (`data:` lines): merge a stream with \
                routed_experts.proxy.StreamMerger, or read one event's JSON with \
                routed_experts.from_response"
            .to_string();
    }
    if first_line.starts_with("HTTP/") {
        return "an HTTP response with its head: pass only its body".to_string();
    }
    if trimmed
        .iter()
        .all(|&c| crate::kernels::b64::is_alphabet(c) || c == b'=')
    {
        let n = s.len();
        let plural = if n == 1 { "" } else { "s" };
        return format!(
            "{n} base64 character{plural}, not a whole number of 4-character groups (cut short?)"
        );
    }
    let key_char = |c: char| c.is_ascii_alphanumeric() || "-_.:".contains(c);
    if s.len() <= 256 && s.chars().all(key_char) {
        return format!(
            "a short key {}: lmdeploy with Ray transport returns a key into its shared store \
             here; fetch the routing from that store in lmdeploy's client and pass the array",
            quote(trimmed)
        );
    }
    format!("plain text of {} bytes, {}", trimmed.len(), quote(trimmed))
}

fn binary(text: &[u8]) -> String {
    let head: Vec<String> = text.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!(
        "binary data of {} bytes, starting {}",
        text.len(),
        head.join(" ")
    )
}

/// The first bytes of `text`, quoted (escapes shown), marked when cut.
fn quote(text: &[u8]) -> String {
    let cut = text.len() > QUOTE_BYTES;
    let shown = String::from_utf8_lossy(&text[..text.len().min(QUOTE_BYTES)]);
    format!("{shown:?}{}", if cut { " ..." } else { "" })
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[test]
    fn each_kind_is_named() {
        let cases: &[(&[u8], &str)] = &[
            (b" \n", "only whitespace"),
            (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", "PNG image"),
            (b"\x1f\x8b\x08\0", "gzip"),
            (b"\x93NUMPY\x01\0", ".npy file"),
            (b"\x80\x04\x95", "pickle"),
            (
                b"\0\x01\x02\x03",
                "binary data of 4 bytes, starting 00 01 02 03",
            ),
            (
                b"data: {\"choices\":[]}\n\ndata: [DONE]\n",
                "server-sent event",
            ),
            (b"HTTP/1.1 200 OK\r\n", "HTTP response"),
            (b"AAAAAAB", "7 base64 characters"),
            (b"routed_experts-3f2a-17", "shared store"),
            (
                b"root:x:0:0:root:/root:/bin/bash\n",
                "plain text of 31 bytes, \"root:x:0:0:root:",
            ),
            (
                b"not routing at all!",
                "plain text of 19 bytes, \"not routing at all!\"",
            ),
        ];
        for (text, said) in cases {
            let d = describe(text);
            assert!(d.contains(said), "{text:?}: {d}");
        }
    }

    #[test]
    fn a_long_text_is_quoted_in_part() {
        let d = describe("word ".repeat(100).as_bytes());
        assert!(d.ends_with(" ..."), "{d}");
        assert!(d.len() < 120, "{d}");
    }
}
