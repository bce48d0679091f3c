//! How typed config fields are spelled in the file: durations as whole seconds or milliseconds (the key says
//! which: `*_secs`, `*_ms`), addresses as `HOST:PORT`, a listener that can be turned `"off"`.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, de::Error};

/// `*_secs = N`.
pub fn secs<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_secs)
}

/// `*_secs = N` where 0 would make no sense (a timeout that fires at once, a push every 0 s).
pub fn positive_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    match u64::deserialize(d)? {
        0 => Err(D::Error::custom("must be at least 1")),
        s => Ok(Duration::from_secs(s)),
    }
}

/// `*_ms = N`.
pub fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_millis)
}

/// A count that must be at least 1.
pub fn at_least_one<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    match usize::deserialize(d)? {
        0 => Err(D::Error::custom("must be at least 1")),
        n => Ok(n),
    }
}

/// `"HOST:PORT"`.
pub fn host_port<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    let text = String::deserialize(d)?;
    parse_host_port(&text).map_err(D::Error::custom)
}

/// `"HOST:PORT"` or `"off"` (None).
pub fn host_port_or_off<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    let text = String::deserialize(d)?;
    if text == "off" {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|e| D::Error::custom(format!("{text:?} is not HOST:PORT or \"off\" ({e})")))
}

pub fn parse_host_port(text: &str) -> Result<SocketAddr, String> {
    text.parse().map_err(|e| format!("{text:?} is not HOST:PORT ({e})"))
}

/// A default address (a constant known to parse).
pub fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)))
}
