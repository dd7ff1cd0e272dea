//! What an operator sets: every proxy setting declared once, here, with its name, unit,
//! default, bound and help. The struct [`Config`], its defaults, its check and [`SETTINGS`] (what
//! the Python config, the command's flags and docs/proxy.md's table are made from or checked
//! against) all come from the one list below.

use std::path::PathBuf;
use std::time::Duration;

pub use super::config_error::ConfigError;
use super::policy::Policy;

/// What a setting counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// A duration, given in seconds (fractions allowed); must be positive.
    Seconds,
    /// A whole number of things (requests, failures, connections).
    Count,
    /// A number of bytes.
    Bytes,
}

impl Unit {
    /// The unit's name, as the Python side reads it.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Seconds => "seconds",
            Unit::Count => "count",
            Unit::Bytes => "bytes",
        }
    }
}

/// One setting as declared: what the command's flag, the Python field and the docs show.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// The field's name (`max_in_flight`); the flag is `--max-in-flight`.
    pub name: &'static str,
    /// What it counts.
    pub unit: Unit,
    /// Its default (whole seconds for durations).
    pub default: u64,
    /// The smallest value that can serve (durations: any positive value; this is 1).
    pub minimum: u64,
    /// What it bounds and what happens beyond it.
    pub help: &'static str,
}

/// A value for [`Config::set`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    /// Seconds, for a duration.
    Seconds(f64),
    /// A whole number, for a count or a size.
    Whole(u64),
}

macro_rules! settings {
    (@type Seconds) => { Duration };
    (@type Count) => { usize };
    (@type Bytes) => { usize };
    (@default Seconds, $d:expr) => { Duration::from_secs($d) };
    (@default $unit:ident, $d:expr) => { $d as usize };
    (@ok Seconds, $v:expr, $min:expr) => { !$v.is_zero() };
    (@ok $unit:ident, $v:expr, $min:expr) => { $v as u64 >= $min };
    ($( $name:ident: $unit:ident = $default:expr, at least $min:expr, $help:literal; )*) => {
        /// The proxy's upstreams, timeouts and limits. `Config::default()` holds the documented
        /// defaults; [`Config::check`] refuses values that would serve nothing.
        #[derive(Clone, Debug)]
        pub struct Config {
            /// Prefill servers' base URLs (`http://HOST:PORT[/PREFIX]`).
            pub prefill: Vec<String>,
            /// Decode servers' base URLs.
            pub decode: Vec<String>,
            /// Sent as `Authorization: Bearer` instead of the client's header.
            pub upstream_api_key: Option<String>,
            /// How a prefill server is picked (default: by session, else least load).
            pub prefill_policy: Policy,
            /// How a decode server is picked (default: least load).
            pub decode_policy: Policy,
            /// A request header whose value is the session key (e.g. `X-Session-Id`); when
            /// absent from a request, its body's `session_id` is.
            pub session_header: Option<String>,
            /// A file listing the servers (`prefill URL` or `decode URL` a line), read at start
            /// and again on SIGHUP; then `prefill` and `decode` stay empty.
            pub upstreams_file: Option<PathBuf>,
            /// How the merged routing is written for the client (default: the decode engine's
            /// own format).
            pub routing_format: RoutingFormat,
            /// How a completions or chat stream gets its routing (default: buffered).
            pub stream_routing: StreamRouting,
            /// How a plain answer carries its choices' prompt rows (default: in every choice).
            pub prompt_routing: PromptRouting,
            /// Whether decode requests carry the project's vLLM plugin's marker (default: off).
            pub vllm_plugin: VllmPlugin,
            $(
                #[doc = $help]
                pub $name: settings!(@type $unit),
            )*
        }

        impl Default for Config {
            fn default() -> Self {
                Config {
                    prefill: Vec::new(),
                    decode: Vec::new(),
                    upstream_api_key: None,
                    prefill_policy: Policy::Session,
                    decode_policy: Policy::LeastLoad,
                    session_header: None,
                    upstreams_file: None,
                    routing_format: RoutingFormat::Engine,
                    stream_routing: StreamRouting::Buffered,
                    prompt_routing: PromptRouting::PerChoice,
                    vllm_plugin: VllmPlugin::Off,
                    $( $name: settings!(@default $unit, $default), )*
                }
            }
        }

        /// Every setting, in the order the command's help lists them.
        pub const SETTINGS: &[Setting] = &[
            $( Setting {
                name: stringify!($name),
                unit: Unit::$unit,
                default: $default,
                minimum: $min,
                help: $help,
            }, )*
        ];

        impl Config {
            /// Set the setting `name` (as [`SETTINGS`] names it) to `value`, checked against its
            /// unit and bound; `Err` says which and why.
            pub fn set(&mut self, name: &str, value: Value) -> Result<(), ConfigError> {
                let setting = setting(name)?;
                match (setting.unit, value) {
                    (Unit::Seconds, Value::Seconds(s)) => {
                        let d = Duration::try_from_secs_f64(s)
                            .ok()
                            .filter(|d| !d.is_zero())
                            .ok_or_else(|| below(setting, &s.to_string()))?;
                        self.set_duration(name, d);
                    }
                    (Unit::Count | Unit::Bytes, Value::Whole(n)) => {
                        if n < setting.minimum {
                            return Err(below(setting, &n.to_string()));
                        }
                        let n = usize::try_from(n).map_err(|_| below(setting, &n.to_string()))?;
                        self.set_whole(name, n);
                    }
                    (unit, _) => {
                        let message = format!("{name}: expected {}, got {value:?}", unit.name());
                        return Err(ConfigError::new(name, message));
                    }
                }
                Ok(())
            }

            fn set_duration(&mut self, name: &str, d: Duration) {
                $( settings!(@set_duration self, name, d, $name, $unit); )*
            }

            fn set_whole(&mut self, name: &str, n: usize) {
                $( settings!(@set_whole self, name, n, $name, $unit); )*
            }

            /// `Err(message)` naming the first setting that cannot serve (a zero limit or
            /// timeout, a value below its bound, a bad upstream URL); `Ok(())` otherwise.
            pub fn check(&self) -> Result<(), ConfigError> {
                self.check_settings()?;
                self.check_upstreams()
            }

            /// The timeouts and limits alone (what [`Config::check`] checks before the
            /// servers).
            pub(crate) fn check_settings(&self) -> Result<(), ConfigError> {
                $(
                    if !settings!(@ok $unit, self.$name, $min) {
                        return Err(below(setting(stringify!($name))?, &format!("{:?}", self.$name)));
                    }
                )*
                Ok(())
            }
        }
    };
    (@set_duration $self:ident, $n:ident, $d:ident, $name:ident, Seconds) => {
        if $n == stringify!($name) { $self.$name = $d; }
    };
    (@set_duration $self:ident, $n:ident, $d:ident, $name:ident, $unit:ident) => {};
    (@set_whole $self:ident, $n:ident, $v:ident, $name:ident, Seconds) => {};
    (@set_whole $self:ident, $n:ident, $v:ident, $name:ident, $unit:ident) => {
        if $n == stringify!($name) { $self.$name = $v; }
    };
}

settings! {
    read_timeout: Seconds = 600, at least 1,
        "seconds an upstream may stay silent (a plain request waits for the whole generation)";
    connect_timeout: Seconds = 10, at least 1, "seconds to connect to an upstream";
    max_in_flight: Count = 256, at least 1,
        "completion requests served at once; more get 503 with Retry-After";
    max_request_bytes: Bytes = 64 << 20, at least 1, "largest client body; larger gets 413";
    body_timeout: Seconds = 60, at least 1,
        "seconds to receive a client's whole body; slower gets 408 (a request takes a \
         completion slot only once its body is whole)";
    max_buffered_bytes: Bytes = 1 << 30, at least 1,
        "bytes held in bodies at once (client bodies being received, upstream replies being \
         read and merged); beyond gets 503 + Retry-After";
    max_upstream_bytes: Bytes = 256 << 20, at least 1,
        "largest upstream body or stream event; larger is a 502";
    eject_after: Count = 3, at least 1, "failures in a row that take an upstream out of rotation";
    eject_seconds: Seconds = 10, at least 1,
        "seconds an ejected upstream stays out before a trial request";
    header_timeout: Seconds = 30, at least 1,
        "seconds from accept to a whole request head; slower gets 408 and is closed (an idle \
         keep-alive connection is closed after as long)";
    max_header_bytes: Bytes = 64 << 10, at least MIN_HEADER_BYTES as u64,
        "largest request head (request line and headers); larger gets 431";
    max_connections: Count = 4096, at least 1,
        "client connections open at once; more get 503 and are closed (logged)";
    request_timeout: Seconds = 3600, at least 1,
        "seconds for a whole request, streams included; beyond: 504, or a last error event on \
         a stream";
    write_timeout: Seconds = 60, at least 1,
        "seconds a write to a client may wait (a client that stopped reading); beyond, the \
         connection is closed";
    shutdown_timeout: Seconds = 30, at least 1,
        "on SIGTERM/SIGINT: seconds for requests under way to finish before they are cancelled \
         (a second signal stops at once)";
    max_merge_bytes: Bytes = routed_experts::DEFAULT_MAX_BYTES as u64, at least 1,
        "largest routing one merge decodes (a half, or the merge); larger is a 502 naming the \
         side";
}

/// hyper's smallest read buffer, which bounds the smallest header limit it can apply.
pub const MIN_HEADER_BYTES: usize = 8192;

/// The declaration of `name`, or an error naming it.
pub fn setting(name: &str) -> Result<&'static Setting, ConfigError> {
    SETTINGS
        .iter()
        .find(|s| s.name == name)
        .ok_or_else(|| ConfigError::new(name, format!("unknown proxy setting {name:?}")))
}

fn below(s: &Setting, got: &str) -> ConfigError {
    let message = match s.unit {
        Unit::Seconds => format!("{} must be a positive number of seconds, got {got}", s.name),
        _ => format!("{} must be at least {}, got {got}", s.name, s.minimum),
    };
    ConfigError::new(s.name, message)
}

/// How the merged routing is written for the client (`routing_format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutingFormat {
    /// A compact sidecar (format.md §3.1), whatever the engines sent: one shape for every
    /// engine, with its start.
    Compact,
    /// The decode engine's own format (`MergeOptions::keep_format`): vLLM's `.npy` text for
    /// vLLM, what a client written against one engine already reads. Same-dtype `.npy` halves
    /// are merged mostly by copying their text.
    Engine,
}

impl RoutingFormat {
    /// Every choice, in the order the help lists them.
    pub const ALL: [RoutingFormat; 2] = [RoutingFormat::Compact, RoutingFormat::Engine];

    /// Its name in the settings.
    pub fn name(self) -> &'static str {
        match self {
            RoutingFormat::Compact => "compact",
            RoutingFormat::Engine => "engine",
        }
    }

    /// The choice `name` names; `Err` lists the names.
    pub fn parse(name: &str) -> Result<Self, String> {
        super::config_error::parse_named(&Self::ALL, Self::name, name)
    }
}

/// How a `/v1/completions` or `/v1/chat/completions` stream request gets its routing
/// (`stream_routing`). Generate streams are always relayed: vLLM's carry routing on their
/// finishing event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamRouting {
    /// Decode is asked plainly and its merged answer is sent as the stream the client asked
    /// for, the routing on each choice's finishing chunk (the tokens come together, once
    /// decode is done). vLLM streams no routing on these endpoints.
    Buffered,
    /// Decode's own stream is relayed as it comes, its routing event merged; a stream that
    /// ends without routing ends with an error event. For engines that stream routing there
    /// (SGLang 0.5.9+).
    Relay,
}

impl StreamRouting {
    /// Every choice, in the order the help lists them.
    pub const ALL: [StreamRouting; 2] = [StreamRouting::Buffered, StreamRouting::Relay];

    /// Its name in the settings.
    pub fn name(self) -> &'static str {
        match self {
            StreamRouting::Buffered => "buffered",
            StreamRouting::Relay => "relay",
        }
    }

    /// The choice `name` names; `Err` lists the names.
    pub fn parse(name: &str) -> Result<Self, String> {
        super::config_error::parse_named(&Self::ALL, Self::name, name)
    }
}

/// How a plain answer carries its choices' prompt rows (`prompt_routing`, or a request's
/// `routed_experts_prompt_routing`; format.md §4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PromptRouting {
    /// Every choice's value holds its whole sequence, prompt rows included, as one engine
    /// answers: a group of `n` choices carries the prompt's rows `n` times.
    PerChoice,
    /// The prompt's rows once, as a compact sidecar at the top-level `prompt_routed_experts`,
    /// and each choice's value (a compact sidecar) its rows after them.
    Shared,
}

impl PromptRouting {
    /// Every choice, in the order the help lists them.
    pub const ALL: [PromptRouting; 2] = [PromptRouting::PerChoice, PromptRouting::Shared];

    /// Its name in the settings and in a request's `routed_experts_prompt_routing`.
    pub fn name(self) -> &'static str {
        match self {
            PromptRouting::PerChoice => "per_choice",
            PromptRouting::Shared => "shared",
        }
    }

    /// The choice `name` names; `Err` lists the names.
    pub fn parse(name: &str) -> Result<Self, String> {
        super::config_error::parse_named(&Self::ALL, Self::name, name)
    }
}

/// Whether the proxy marks its decode requests for the project's vLLM plugin (`vllm_plugin`;
/// `routed_experts/vllm_plugin.py`: a vLLM 0.33 decode server with routing on then loads
/// prefill's KV instead of computing the prompt again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VllmPlugin {
    /// Decode is asked as vLLM is by any router.
    Off,
    /// Every decode request's `kv_transfer_params` carries `"routed_experts_plugin": true`.
    Mark,
}

impl VllmPlugin {
    /// Every choice, in the order the help lists them.
    pub const ALL: [VllmPlugin; 2] = [VllmPlugin::Off, VllmPlugin::Mark];

    /// Its name in the settings.
    pub fn name(self) -> &'static str {
        match self {
            VllmPlugin::Off => "off",
            VllmPlugin::Mark => "mark",
        }
    }

    /// The choice `name` names; `Err` lists the names.
    pub fn parse(name: &str) -> Result<Self, String> {
        super::config_error::parse_named(&Self::ALL, Self::name, name)
    }
}

/// The settings that take text, beside [`SETTINGS`]: `(name, default, help)`.
pub const TEXT_SETTINGS: &[(&str, Option<&str>, &str)] = &[
    (
        "upstream_api_key",
        None,
        "sent to the servers as `Authorization: Bearer` instead of the client's header",
    ),
    (
        "prefill_policy",
        Some("session"),
        "how a prefill server is picked: round_robin, least_load (fewest requests under way) \
         or session (a session's requests to the server its key ranks first, within a bound \
         on any server's share; without a key, least load)",
    ),
    (
        "decode_policy",
        Some("least_load"),
        "how a decode server is picked: round_robin, least_load or session",
    ),
    (
        "session_header",
        None,
        "a request header whose value is the session key (e.g. X-Session-Id); without it in a \
         request, the body's session_id is the key",
    ),
    (
        "routing_format",
        Some("engine"),
        "how the merged routing reaches the client: engine (the default: in the decode \
         engine's own format, e.g. vLLM's .npy text, as a client of one engine reads it) or \
         compact (a compact sidecar, whatever the engines sent)",
    ),
    (
        "stream_routing",
        Some("buffered"),
        "how a completions or chat stream gets its routing: buffered (the default: decode is \
         asked plainly and its answer sent as the stream asked for, each choice's routing on \
         its finishing chunk, the tokens together at the end; vLLM streams no routing there) \
         or relay (decode's stream relayed as it comes, for engines that stream routing, such \
         as SGLang; one that ends without routing ends with an error event)",
    ),
    (
        "prompt_routing",
        Some("per_choice"),
        "how a plain answer carries its choices' prompt rows: per_choice (the default: each \
         choice's routing holds its whole sequence, as one engine answers) or shared (the \
         prompt's rows once, at the top-level prompt_routed_experts, and each choice's own rows \
         after them, all as compact sidecars: a group of n choices carries the prompt once); a \
         request's routed_experts_prompt_routing chooses for itself",
    ),
    (
        "vllm_plugin",
        Some("off"),
        "off (the default) or mark: every decode request's kv_transfer_params carries \
         routed_experts_plugin=true, with which a vLLM 0.33 decode server running the \
         project's plugin (ROUTED_EXPERTS_VLLM_PLUGIN=1) loads prefill's KV with routing on \
         instead of computing the prompt again",
    ),
    (
        "upstreams_file",
        None,
        "a file listing the servers, `prefill URL` or `decode URL` a line (# comments), read \
         at start and again on SIGHUP, instead of --prefill/--decode",
    ),
];

impl Config {
    /// Set the text setting `name` (one of [`TEXT_SETTINGS`]), checked; `Err` says which and
    /// why.
    pub fn set_text(&mut self, name: &str, value: &str) -> Result<(), ConfigError> {
        match name {
            "upstream_api_key" => self.upstream_api_key = Some(value.to_string()),
            "prefill_policy" => {
                self.prefill_policy = Policy::parse(value)
                    .map_err(|e| ConfigError::new(name, format!("{name}: {e}")))?
            }
            "decode_policy" => {
                self.decode_policy = Policy::parse(value)
                    .map_err(|e| ConfigError::new(name, format!("{name}: {e}")))?
            }
            "session_header" => {
                hyper::header::HeaderName::from_bytes(value.as_bytes()).map_err(|_| {
                    let m =
                        format!("{name}: expected a header name like X-Session-Id, got {value:?}");
                    ConfigError::new(name, m)
                })?;
                self.session_header = Some(value.to_string());
            }
            "upstreams_file" => self.upstreams_file = Some(PathBuf::from(value)),
            "routing_format" => {
                self.routing_format = RoutingFormat::parse(value)
                    .map_err(|e| ConfigError::new(name, format!("{name}: {e}")))?
            }
            "stream_routing" => {
                self.stream_routing = StreamRouting::parse(value)
                    .map_err(|e| ConfigError::new(name, format!("{name}: {e}")))?
            }
            "prompt_routing" => {
                self.prompt_routing = PromptRouting::parse(value)
                    .map_err(|e| ConfigError::new(name, format!("{name}: {e}")))?
            }
            "vllm_plugin" => {
                self.vllm_plugin = VllmPlugin::parse(value)
                    .map_err(|e| ConfigError::new(name, format!("{name}: {e}")))?
            }
            _ => {
                let message = format!("unknown proxy setting {name:?}");
                return Err(ConfigError::new(name, message));
            }
        }
        Ok(())
    }

    /// The prefill and decode servers: `prefill` and `decode`, or the upstreams file's.
    pub fn upstream_lists(&self) -> Result<(Vec<String>, Vec<String>), ConfigError> {
        let Some(path) = &self.upstreams_file else {
            return Ok((self.prefill.clone(), self.decode.clone()));
        };
        let file = |e: String| {
            ConfigError::new(
                "upstreams_file",
                format!("upstreams_file {}: {e}", path.display()),
            )
        };
        if !self.prefill.is_empty() || !self.decode.is_empty() {
            let message = "give the servers either in upstreams_file or as prefill and decode, \
                           not both";
            return Err(ConfigError::new("upstreams_file", message));
        }
        let text = std::fs::read_to_string(path).map_err(|e| file(e.to_string()))?;
        read_upstreams(&text).map_err(|e| file(e.message))
    }

    fn check_upstreams(&self) -> Result<(), ConfigError> {
        let (prefill, decode) = self.upstream_lists()?;
        for (side, urls) in [("prefill", &prefill), ("decode", &decode)] {
            if urls.is_empty() {
                return Err(ConfigError::new(
                    side,
                    format!("give at least one {side} server"),
                ));
            }
            for url in urls {
                super::upstream::Target::parse(url)
                    .map_err(|e| ConfigError::new(side, format!("{side}: {e}")))?;
            }
        }
        Ok(())
    }
}

/// The servers an upstreams file lists: a line is `prefill URL` or `decode URL`; blank lines
/// and `#` comments are skipped. `Err` names the line.
pub fn read_upstreams(text: &str) -> Result<(Vec<String>, Vec<String>), ConfigError> {
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let (side, url) = (words.next().unwrap_or(""), words.next());
        let list = match (side, url, words.next()) {
            ("prefill", Some(_), None) => &mut prefill,
            ("decode", Some(_), None) => &mut decode,
            _ => {
                let shown: String = line.chars().take(80).collect();
                let message = format!(
                    "line {}: expected `prefill URL` or `decode URL`, got {shown:?}",
                    n + 1
                );
                return Err(ConfigError::new("upstreams_file", message));
            }
        };
        let url = url.unwrap_or_default();
        super::upstream::Target::parse(url)
            .map_err(|e| ConfigError::new(side, format!("line {}: {e}", n + 1)))?;
        list.push(url.to_string());
    }
    Ok((prefill, decode))
}

#[cfg(test)]
mod tests;
