//! WebSocket capture: the relay's byte chunks in, provider exchanges out.
//!
//! The data path (`proxy::websocket`) copies bytes between client and upstream and hands each chunk it relayed
//! to a [`DirectionTap`]: one small copy charged to the capture budget and one non-blocking send on a bounded
//! channel. Everything else happens on this module's one thread, at background priority: frames are read per
//! direction ([`frames`]), messages reassembled (unmasked, joined, inflated), and a per-socket [`session`] turns
//! messages into [`RawExchange`]s that go down the capture queue like any HTTP exchange:
//! - Responses WebSocket mode (`/responses`): one exchange per `response.create`, its request rebuilt whole
//!   across `previous_response_id` chains on the socket and its events written as the SSE stream a `POST
//!   /v1/responses` would have returned, so the Responses adapter, derivation and exports need nothing new;
//! - Realtime (`/realtime`): one exchange per response (`response.create` → `response.done`);
//! - any other WebSocket: one raw exchange at close, the messages of each direction as they were.
//!
//! When the budget is spent or the channel is full, that direction's capture stops (a chunk lost would leave
//! its framing unreadable): what is pending is emitted cut and marked, forwarding goes on untouched.

pub mod frames;
pub mod session;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::Duration;

use bytes::Bytes;
use rustc_hash::FxHashMap;

use super::budget::{Budget, Charge};
use super::{CaptureTx, ExchangeMeta, HeaderList, UnixMicros, now_micros};
use crate::model::exchange::Api;
use frames::{FrameReader, Message, negotiated_deflate};
use session::Session;

/// Chunks waiting for the capture thread, over all sockets (their bytes count in the capture budget too).
const CHANNEL_CHUNKS: usize = 4096;

/// Which way the bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client → upstream (masked frames).
    FromClient,
    /// Upstream → client.
    FromUpstream,
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Direction::FromClient => 0,
            Direction::FromUpstream => 1,
        }
    }
}

/// What the socket carries, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OpenAI Responses WebSocket mode.
    Responses,
    /// OpenAI Realtime.
    Realtime,
    /// Anything else: kept as raw messages.
    Raw,
}

impl Protocol {
    /// Decided from the upstream path (its query left out).
    pub fn of_path(path: &str) -> Protocol {
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        if path.ends_with("/responses") {
            Protocol::Responses
        } else if path.ends_with("/realtime") {
            Protocol::Realtime
        } else {
            Protocol::Raw
        }
    }
}

/// The upgrade as the data path saw it; every exchange of the socket carries it.
#[derive(Debug, Clone)]
pub struct SocketInfo {
    pub upstream: Arc<str>,
    /// Path and query as sent upstream, secrets redacted.
    pub path: String,
    pub protocol: Protocol,
    /// The client's upgrade request headers, redacted.
    pub request_headers: HeaderList,
    /// The upstream's 101 headers, redacted.
    pub response_headers: HeaderList,
    pub meta: ExchangeMeta,
    /// When the upgrade request arrived.
    pub start: UnixMicros,
}

struct Shared {
    id: u64,
    info: SocketInfo,
    ended: [AtomicBool; 2],
    /// A chunk of that direction could not be handed over: its capture stopped there.
    cut: [AtomicBool; 2],
    /// Its exchanges were emitted (a socket's two `End`s may both find it ended).
    finished: AtomicBool,
}

impl Shared {
    fn all_ended(&self) -> bool {
        self.ended.iter().all(|e| e.load(Ordering::Acquire))
    }
}

enum Event {
    Chunk {
        socket: Arc<Shared>,
        direction: Direction,
        bytes: Bytes,
        at: UnixMicros,
        /// Released when the capture thread is done with the chunk.
        _charge: Charge,
    },
    End {
        socket: Arc<Shared>,
    },
    /// Shutdown (`WsCapture::close`): finish every socket and end the thread.
    Stop,
}

/// The data path's handle on WebSocket capture (one per proxy).
pub struct WsCapture {
    tx: SyncSender<Event>,
    budget: Budget,
    next_id: AtomicU64,
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl WsCapture {
    /// Starts the capture thread; it sends what it builds on `capture`, messages kept up to `cap` bytes each.
    pub fn start(capture: CaptureTx, cap: usize) -> std::io::Result<WsCapture> {
        let (tx, rx) = sync_channel(CHANNEL_CHUNKS);
        let budget = capture.budget().clone();
        let thread = std::thread::Builder::new()
            .name("llmtap-ws-capture".into())
            .spawn(move || run(rx, capture, cap))?;
        Ok(WsCapture {
            tx,
            budget,
            next_id: AtomicU64::new(1),
            thread: std::sync::Mutex::new(Some(thread)),
        })
    }

    /// Shutdown, once the relays are gone: every socket's exchanges are handed to the capture queue, then the
    /// thread ends (and lets go of its `CaptureTx`). Blocking. Taps still open after this capture nothing.
    pub fn close(&self) {
        // Blocking: the `Stop` must come after every chunk already queued, not be lost to a full channel.
        let _ = self.tx.send(Event::Stop);
        let thread = self.thread.lock().ok().and_then(|mut t| t.take());
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }

    /// Taps for a socket just upgraded: (client → upstream, upstream → client).
    pub fn open(&self, info: SocketInfo) -> (DirectionTap, DirectionTap) {
        let shared = Arc::new(Shared {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            info,
            ended: Default::default(),
            cut: Default::default(),
            finished: AtomicBool::new(false),
        });
        let tap = |direction| DirectionTap {
            tx: self.tx.clone(),
            budget: self.budget.clone(),
            socket: shared.clone(),
            direction,
            cut: false,
        };
        (tap(Direction::FromClient), tap(Direction::FromUpstream))
    }
}

/// One direction of one socket on the data path: a copy of each relayed chunk, charged and sent without
/// blocking. Dropped when that direction ends.
pub struct DirectionTap {
    tx: SyncSender<Event>,
    budget: Budget,
    socket: Arc<Shared>,
    direction: Direction,
    cut: bool,
}

impl DirectionTap {
    /// `data` was just relayed.
    pub fn record(&mut self, data: &[u8]) {
        if self.cut || data.is_empty() {
            return;
        }
        let mut charge = Charge::default();
        if !self.budget.reserve(&mut charge, data.len() as u64) {
            self.budget.metrics().capture_over_budget();
            self.stop();
            return;
        }
        let event = Event::Chunk {
            socket: self.socket.clone(),
            direction: self.direction,
            bytes: Bytes::copy_from_slice(data),
            at: now_micros(),
            _charge: charge,
        };
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(event) {
            self.stop();
        }
    }

    fn stop(&mut self) {
        self.cut = true;
        self.socket.cut[self.direction.index()].store(true, Ordering::Release);
    }
}

impl Drop for DirectionTap {
    fn drop(&mut self) {
        self.socket.ended[self.direction.index()].store(true, Ordering::Release);
        // Lost when the channel is full: the thread's sweep finds the socket ended anyway.
        let _ = self.tx.try_send(Event::End {
            socket: self.socket.clone(),
        });
    }
}

/// One socket on the capture thread.
struct Socket {
    shared: Arc<Shared>,
    readers: [FrameReader; 2],
    session: Session,
}

impl Socket {
    fn new(shared: Arc<Shared>, cap: usize) -> Socket {
        let (client, server) = negotiated_deflate(shared.info.response_headers.get("sec-websocket-extensions"));
        let session = Session::new(&shared.info, shared.id, cap);
        Socket {
            readers: [FrameReader::new(cap, client), FrameReader::new(cap, server)],
            session,
            shared,
        }
    }

    fn feed(&mut self, direction: Direction, bytes: &[u8], at: UnixMicros, capture: &CaptureTx) {
        let mut messages: Vec<Message> = Vec::new();
        self.readers[direction.index()].feed(bytes, at, &mut messages);
        for m in messages {
            self.session.message(&self.shared.info, direction, m, capture);
        }
    }

    fn finish(mut self, capture: &CaptureTx) {
        if self.shared.finished.swap(true, Ordering::AcqRel) {
            return;
        }
        let now = now_micros();
        for direction in [Direction::FromClient, Direction::FromUpstream] {
            if let Some(m) = self.readers[direction.index()].unfinished(now) {
                self.session.message(&self.shared.info, direction, m, capture);
            }
        }
        let cut = self.shared.cut.iter().any(|c| c.load(Ordering::Acquire))
            || self.readers.iter().any(|r| r.broken().is_some());
        if cut {
            capture.metrics().capture_truncated.inc();
        }
        self.session.close(&self.shared.info, cut, now, capture);
    }
}

fn run(rx: Receiver<Event>, capture: CaptureTx, cap: usize) {
    crate::background::run_in_background();
    let mut sockets: FxHashMap<u64, Socket> = FxHashMap::default();
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(Event::Chunk {
                socket,
                direction,
                bytes,
                at,
                _charge,
            }) => {
                let id = socket.id;
                sockets
                    .entry(id)
                    .or_insert_with(|| Socket::new(socket, cap))
                    .feed(direction, &bytes, at, &capture);
            }
            Ok(Event::End { socket }) => {
                if socket.all_ended() {
                    // Every chunk of both directions was sent before its `End`, so all are read by now.
                    match sockets.remove(&socket.id) {
                        Some(s) => s.finish(&capture),
                        None => Socket::new(socket, cap).finish(&capture),
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                // The channel is empty: a socket whose directions both ended has nothing more coming (its `End`
                // may have been lost to a full channel).
                let done: Vec<u64> = sockets
                    .iter()
                    .filter(|(_, s)| s.shared.all_ended())
                    .map(|(id, _)| *id)
                    .collect();
                for id in done {
                    if let Some(s) = sockets.remove(&id) {
                        s.finish(&capture);
                    }
                }
            }
            Ok(Event::Stop) | Err(RecvTimeoutError::Disconnected) => {
                for (_, s) in sockets.drain() {
                    s.finish(&capture);
                }
                return;
            }
        }
    }
}

/// The API a socket's exchanges are normalized as.
fn api_of(protocol: Protocol) -> Api {
    match protocol {
        Protocol::Responses | Protocol::Realtime => Api::OpenAiResponses,
        Protocol::Raw => Api::Other,
    }
}
