//! Command line. Pipeline shape lives in the config file; runtime-only knobs are flags.

pub mod replay;
pub mod run;
pub mod search;
pub mod sessions;
pub mod tail;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "llmtap",
    version,
    about = "Transparent LLM proxy that captures calls and derives agent steps"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args, Clone)]
pub struct StoreArgs {
    /// Config file (TOML); its data_dir is used unless --data-dir is given.
    #[arg(long, short = 'c', env = "LLMTAP_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory holding the store (default: $LLMTAP_DATA_DIR, else $XDG_DATA_HOME/llmtap, else ~/.local/share/llmtap).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Read the team's shared store instead of the local one: a PostgreSQL URL
    /// (postgres://user:password@host:5432/db). Ignored by `serve` (which takes `[store] url`).
    #[arg(long, env = "LLMTAP_STORE", value_name = "URL")]
    pub store: Option<String>,
}

#[derive(Debug, Args, Clone, Default)]
pub struct Selection {
    /// Only the calls of this agent run (an id `llmtap sessions` shows) or of this trajectory.
    #[arg(long)]
    pub session: Option<String>,
    /// Only calls started at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Only calls started at or before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<String>,
}

pub use crate::model::format::ExportFormat;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    Serve {
        #[command(flatten)]
        store: StoreArgs,
        /// Address to listen on (default 127.0.0.1:8787). Binding beyond loopback must be asked for.
        #[arg(long)]
        listen: Option<String>,
    },
    /// Validate a config file and print the resolved upstreams.
    CheckConfig {
        #[arg(long, short = 'c')]
        config: Option<PathBuf>,
    },
    /// List sessions and, per session, the tree of trajectories derived from captured traffic.
    Sessions {
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        select: Selection,
        /// Print one JSON line per session (with its trajectories) instead of a table.
        #[arg(long)]
        json: bool,
        /// Also list side calls, titles, warmups and quota probes (folded into a count otherwise).
        #[arg(long)]
        all: bool,
    },
    /// Search the captured steps' text (prompts, outputs, tool arguments and results), newest first: every
    /// word or "quoted phrase" must occur.
    Search {
        #[command(flatten)]
        store: StoreArgs,
        /// What to find (quote a phrase: '"exact words"').
        #[arg(required = true, num_args = 1..)]
        query: Vec<String>,
        /// Only steps whose model (`upstream/model`) contains this.
        #[arg(long)]
        model: Option<String>,
        /// Only steps of this agent (x-llmtap-agent).
        #[arg(long)]
        agent: Option<String>,
        /// Only steps with an error (a failed call, a tool result flagged as one).
        #[arg(long)]
        errors: bool,
        /// Only steps started at or after this RFC 3339 time.
        #[arg(long)]
        since: Option<String>,
        /// Only steps started at or before this RFC 3339 time.
        #[arg(long)]
        until: Option<String>,
        /// Only steps whose call cost at least this many US dollars.
        #[arg(long)]
        min_cost: Option<f64>,
        /// Only steps whose call cost at most this many US dollars.
        #[arg(long)]
        max_cost: Option<f64>,
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// One JSON object per hit.
        #[arg(long)]
        json: bool,
    },
    /// List captured calls.
    Traces {
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        select: Selection,
        #[arg(long)]
        limit: Option<u64>,
        #[arg(long)]
        json: bool,
    },
    /// Export captured data as JSON lines.
    Export {
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        select: Selection,
        #[arg(long, value_enum)]
        format: ExportFormat,
        /// Output file (default: stdout).
        #[arg(long, short = 'o')]
        out: Option<PathBuf>,
    },
    /// Follow a running llmtap: calls and steps as they complete (model, tokens, cost, tool calls and results).
    ///
    /// Reads the gRPC live feed of the llmtap that runs with the same config ([api] listen, default
    /// 127.0.0.1:8788; token from [api] or LLMTAP_API_TOKEN). Reconnects when llmtap restarts.
    Tail {
        /// Config file (TOML) of the running llmtap: where its API listens and its token.
        #[arg(long, short = 'c', env = "LLMTAP_CONFIG")]
        config: Option<PathBuf>,
        /// The API's HOST:PORT, instead of the config's [api] listen.
        #[arg(long)]
        api: Option<String>,
        /// Only calls of this agent run (an id `llmtap sessions` shows) or of this trajectory.
        #[arg(long)]
        session: Option<String>,
        /// Only calls of this agent (x-llmtap-agent).
        #[arg(long)]
        agent: Option<String>,
    },
    /// llmtap's local CA (forward-proxy mode): its path, fingerprint and how to trust or remove it.
    ///
    /// Creates it on first use under the data dir.
    Ca {
        #[command(flatten)]
        store: StoreArgs,
        /// Replace it with a new CA (new key; clients must trust the new one; restart a running llmtap).
        #[arg(long)]
        rotate: bool,
    },
    /// Run a command with its LLM traffic captured, its base URL untouched (forward-proxy mode).
    ///
    /// Sets HTTPS_PROXY, NO_PROXY, NODE_USE_ENV_PROXY, NODE_EXTRA_CA_CERTS, SSL_CERT_FILE, REQUESTS_CA_BUNDLE,
    /// CURL_CA_BUNDLE and CODEX_CA_CERTIFICATE for it, and gives the run a session id. Uses the llmtap
    /// listening at the config's address, or starts one in this process for the run. Exits with the
    /// command's status.
    Run {
        #[command(flatten)]
        store: StoreArgs,
        /// The run's session id (default: a new `run-…` id).
        #[arg(long)]
        session: Option<String>,
        /// The command and its arguments (after `--`).
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<String>,
    },
    /// Re-send a captured call to its provider through the running llmtap, edited; the new call is captured
    /// and linked to the original.
    ///
    /// The response goes to stdout as the provider sends it (a stream as a stream), then the new call's id to
    /// stderr. The key comes from the environment: <UPSTREAM>_API_KEY (ANTHROPIC_API_KEY, OPENAI_API_KEY,
    /// GEMINI_API_KEY or GOOGLE_API_KEY for the built-in routes) or the variable --key-env names.
    Replay {
        #[command(flatten)]
        store: StoreArgs,
        #[command(flatten)]
        args: replay::ReplayArgs,
    },
    /// Print a running llmtap's counters (from its /metrics endpoint).
    Status {
        /// Address of the running llmtap.
        #[arg(long, default_value = crate::config::DEFAULT_LISTEN)]
        addr: String,
        /// Config file (TOML) of the running llmtap: its `[api] token`, sent as a bearer token (a proxy listening
        /// beyond loopback serves /metrics only with it; LLMTAP_API_TOKEN wins).
        #[arg(long, short = 'c', env = "LLMTAP_CONFIG")]
        config: Option<PathBuf>,
    },
}
