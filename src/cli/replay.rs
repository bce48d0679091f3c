//! `llmtap replay CALL_ID [--model M] [--set POINTER=VALUE]... [--unset POINTER]... [--body-file FILE]`: re-send a
//! captured call through the running llmtap's proxy (`api::replay`), its response streamed to stdout as the
//! provider sends it, then where the new call was captured on stderr.
//!
//! The key is read from the environment (`api::replay::key_variables`, or `--key-env NAME`), never from an
//! argument (argument lists are visible to every user of the machine, and land in shell history). No config
//! switch: the command runs as the user, reads the store they can read, and sends with their own key, what
//! "copy as curl" on the call page does by hand; `[viewer] replay` guards the viewer's route, reachable over
//! the network.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::Value;

use crate::api::replay::{self, Edits, ReplayError};
use crate::proxy::redact::Redactor;
use crate::store::{Store, StoreError};

#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The call's id (`llmtap traces`, the viewer's call page).
    pub call: String,
    /// The model to ask instead (the body's `model`, or the path's for Gemini, Vertex and Bedrock).
    #[arg(long)]
    pub model: Option<String>,
    /// Change the body: a JSON pointer (leading `/` optional) and a value, read as JSON when it parses, else as a
    /// string: `--set max_tokens=100 --set /messages/0/content=hello --set stream=false`. Repeatable.
    #[arg(long = "set", value_name = "POINTER=VALUE")]
    pub set: Vec<String>,
    /// Remove a member or an array element of the body: `--unset tools`. Repeatable.
    #[arg(long = "unset", value_name = "POINTER")]
    pub unset: Vec<String>,
    /// Send this JSON body instead of the captured one (`-`: stdin); --set, --unset and --model apply to it.
    #[arg(long, value_name = "FILE")]
    pub body_file: Option<PathBuf>,
    /// The environment variable holding the key (default: `<UPSTREAM>_API_KEY`, e.g. ANTHROPIC_API_KEY,
    /// OPENAI_API_KEY, GEMINI_API_KEY, then GOOGLE_API_KEY for Gemini).
    #[arg(long, value_name = "NAME")]
    pub key_env: Option<String>,
    /// The running llmtap's proxy address (default: the config's `listen`).
    #[arg(long, value_name = "HOST:PORT")]
    pub proxy: Option<String>,
    /// Print the request that would be sent (the key as the variable it comes from) and send nothing.
    #[arg(long)]
    pub dry_run: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayCliError {
    #[error("no call {0} in the store")]
    NotFound(String),
    #[error("--set {0:?} is not POINTER=VALUE")]
    SetSyntax(String),
    #[error("cannot read the body file {path}: {reason}")]
    BodyFile { path: String, reason: String },
    #[error("the call was sent with a key: set {0} (or name another variable with --key-env)")]
    NoKey(String),
    #[error("the replay's capture did not reach the store within {0:?} (status {1}); look for it with `llmtap traces`")]
    NotCaptured(Duration, u16),
    #[error("the provider answered {status}; the replay is captured as {id}")]
    Failed { status: u16, id: String },
    #[error(transparent)]
    Replay(#[from] ReplayError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Output(#[from] std::io::Error),
}

/// What the command needs from the config.
pub struct Setup {
    pub store: Store,
    /// Upstream name → base URL.
    pub upstreams: BTreeMap<String, String>,
    pub redactor: Redactor,
    /// The running llmtap's proxy.
    pub proxy: SocketAddr,
}

/// How long after the answer the replay's capture may take to reach the store.
const CAPTURE_WAIT: Duration = Duration::from_secs(20);

/// `POINTER=VALUE` → the pointer and the value (JSON if it parses, else the text).
pub fn parse_set(arg: &str) -> Result<(String, Value), ReplayCliError> {
    let (pointer, value) = arg
        .split_once('=')
        .filter(|(p, _)| !p.is_empty())
        .ok_or_else(|| ReplayCliError::SetSyntax(arg.to_owned()))?;
    let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
    Ok((pointer.to_owned(), value))
}

fn edits(args: &ReplayArgs) -> Result<Edits, ReplayCliError> {
    let body = match &args.body_file {
        None => None,
        Some(path) => {
            let unreadable = |reason: String| ReplayCliError::BodyFile {
                path: path.display().to_string(),
                reason,
            };
            let text = if path.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).map_err(|e| unreadable(e.to_string()))?
            } else {
                std::fs::read_to_string(path).map_err(|e| unreadable(e.to_string()))?
            };
            Some(serde_json::from_str(&text).map_err(|e| unreadable(format!("not JSON: {e}")))?)
        }
    };
    Ok(Edits {
        body,
        set: args.set.iter().map(|s| parse_set(s)).collect::<Result<_, _>>()?,
        unset: args.unset.clone(),
        model: args.model.clone(),
    })
}

/// Replay `args.call`: the response body to `out` as it arrives; the new call's id returned once captured.
pub async fn run(
    args: &ReplayArgs,
    setup: &Setup,
    env: impl Fn(&str) -> Option<String>,
    out: &mut (impl Write + Send),
    err: &mut impl Write,
) -> Result<Option<String>, ReplayCliError> {
    let edits = edits(args)?;
    let store = setup.store.clone();
    let id = args.call.clone();
    let trace = tokio::task::spawn_blocking(move || store.read(|r| r.trace(&id)))
        .await
        .map_err(|e| StoreError::Thread(std::io::Error::other(e.to_string())))??
        .ok_or_else(|| ReplayCliError::NotFound(args.call.clone()))?;
    let variables = match &args.key_env {
        Some(name) => vec![name.clone()],
        None => replay::key_variables(&trace),
    };
    let key = variables.iter().find_map(|v| env(v).filter(|k| !k.is_empty()));
    let (_, key_needed) = replay::key_header(&trace);
    if key.is_none() && key_needed {
        return Err(ReplayCliError::NoKey(variables.join(" or ")));
    }
    let plan = if args.dry_run {
        // The key's place shows the variable, not the key.
        let shown = format!("${}", variables.first().map_or("KEY", String::as_str));
        replay::plan(
            &trace,
            &setup.upstreams,
            &setup.redactor,
            &edits,
            key.as_ref().map(|_| shown.as_str()),
        )?
    } else {
        replay::plan(&trace, &setup.upstreams, &setup.redactor, &edits, key.as_deref())?
    };
    drop(key);
    if args.dry_run {
        writeln!(
            out,
            "{} http://{}{}",
            plan.method,
            replay::reachable(setup.proxy),
            plan.path
        )?;
        for (k, v) in &plan.headers {
            writeln!(out, "{k}: {}", String::from_utf8_lossy(v.as_bytes()))?;
        }
        writeln!(out)?;
        out.write_all(&plan.body)?;
        writeln!(out)?;
        return Ok(None);
    }
    let session = plan.session.clone();
    let response = replay::send(setup.proxy, plan).await?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    while let Some(frame) = body.frame().await {
        // A body cut by the provider is the replay's result as it is (captured so).
        let Ok(frame) = frame else { break };
        if let Some(data) = frame.data_ref() {
            out.write_all(data)?;
            out.flush()?;
        }
    }
    writeln!(out)?;
    let deadline = Instant::now() + CAPTURE_WAIT;
    let new = loop {
        let (store, original, s) = (setup.store.clone(), args.call.clone(), session.clone());
        let found = tokio::task::spawn_blocking(move || store.read(|r| replay::captured(r, &original, &s)))
            .await
            .map_err(|e| StoreError::Thread(std::io::Error::other(e.to_string())))??;
        if let Some(id) = found {
            break id;
        }
        if Instant::now() >= deadline {
            return Err(ReplayCliError::NotCaptured(CAPTURE_WAIT, status));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    writeln!(
        err,
        "llmtap replay: {} replayed with status {status}, captured as {new} (session {session})",
        args.call
    )?;
    if status >= 400 {
        return Err(ReplayCliError::Failed { status, id: new });
    }
    Ok(Some(new))
}
