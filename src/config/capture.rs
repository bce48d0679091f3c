//! `[capture]`: what is kept of each exchange and how much may wait for the pipeline.

use serde::Deserialize;

use super::{ConfigError, invalid, serde_units};

/// The smallest non-zero `capture.spill_bytes`.
pub const MIN_SPILL_BYTES: u64 = 1024 * 1024;

#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CaptureConfig {
    pub enabled: bool,
    /// Per direction, per exchange. Beyond it the body is still forwarded; the trace is marked truncated.
    pub max_body_bytes: usize,
    /// Exchanges waiting to be processed. When full, new exchanges are dropped and counted (never blocks).
    #[serde(deserialize_with = "serde_units::at_least_one")]
    pub queue_capacity: usize,
    /// Captured bytes (bodies and headers) waiting to be processed; same policy as `queue_capacity`.
    pub queue_bytes: u64,
    /// Exchanges the pipeline cannot take yet are written to `<data_dir>/spill/` up to this many bytes
    /// instead of being dropped (see `capture::spill`); 0 = no spill: a full queue drops.
    pub spill_bytes: u64,
    /// Name fragments redacted in the captured copy besides the built-in rule (see `proxy::redact`): headers
    /// and query parameters, any case and separator style.
    pub redact_headers: Vec<String>,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        CaptureConfig {
            enabled: true,
            max_body_bytes: 32 * 1024 * 1024,
            queue_capacity: 4096,
            queue_bytes: 256 * 1024 * 1024,
            spill_bytes: 1024 * 1024 * 1024,
            redact_headers: Vec::new(),
        }
    }
}

impl CaptureConfig {
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        // A spill smaller than one segment would refuse most exchanges while costing disk writes: a typo
        // (`spill_bytes = 1024` meant as KiB) is a startup error rather than a silent near-drop.
        if self.spill_bytes != 0 && self.spill_bytes < MIN_SPILL_BYTES {
            return Err(invalid(
                "capture.spill_bytes",
                format!("must be 0 (no spill) or at least {MIN_SPILL_BYTES} bytes (1 MiB)"),
            ));
        }
        // Names are compared by their letters and digits only: an entry without any would match nothing.
        if let Some(bad) = self
            .redact_headers
            .iter()
            .find(|n| !n.bytes().any(|b| b.is_ascii_alphanumeric()))
        {
            return Err(invalid(
                "capture.redact_headers",
                format!("{bad:?} has no letter or digit, so it would redact nothing"),
            ));
        }
        Ok(())
    }
}
