//! `TapBody<B>`: forwards every frame of a body unchanged and keeps a refcounted clone of its data.
//!
//! Invariants:
//! - Per-frame work is synchronous and proportional to the frame at most: a `Bytes` clone (refcount bump) for
//!   large frames, a memcpy into one buffer for small ones (see `Tap::keep` for why); no locks, no parsing, no
//!   awaits. When capture is off the tap is `None` and the body is a plain pass-through.
//! - A tap finishes exactly once: at end of stream, on an inner error, or on `Drop` (the client went away, or
//!   hyper dropped the body early). The response tap's finish is the one place an exchange is sent.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};

use super::limits::ClientBody;

use crate::capture::budget::Budget;
use crate::capture::{CaptureTx, Captured, HeaderList, Outcome, RawExchange, now_micros};

/// Where a request body's capture lands when its tap finishes; the response tap reads it once.
/// The lock is taken twice per exchange (put, take), never per frame.
#[derive(Default)]
pub struct RequestSlot {
    captured: Mutex<Option<Captured>>,
    /// The part of the body nobody read, when hyper let go of the request before its end (see [`RequestBody`]).
    rest: Mutex<Option<ClientBody<Incoming>>>,
}

impl RequestSlot {
    fn put(&self, captured: Captured) {
        if let Ok(mut slot) = self.captured.lock() {
            *slot = Some(captured);
        }
    }

    /// The request as captured so far; an empty, un-ended capture if its tap has not finished. (A rest left
    /// unread goes when the slot does, with the exchange: no second lock per exchange for it here.)
    pub fn take(&self) -> Captured {
        self.captured.lock().ok().and_then(|mut s| s.take()).unwrap_or_default()
    }

    /// The unread rest of the body, if hyper let go of it early.
    pub fn take_rest(&self) -> Option<ClientBody<Incoming>> {
        self.rest.lock().ok().and_then(|mut r| r.take())
    }
}

/// The client's request body as it goes upstream. When hyper drops it before its end (the upstream could not be
/// reached, so the request was never written), the rest is left in the exchange's [`RequestSlot`]: the error
/// path reads it from the client to capture the request (`AwaitingUpstream::capture_rest`), so that a failed
/// call keeps its request and model. Nothing changes for a body that is read to its end.
pub struct RequestBody {
    inner: Option<ClientBody<Incoming>>,
    /// None with capture off.
    slot: Option<Arc<RequestSlot>>,
}

impl RequestBody {
    pub fn new(inner: ClientBody<Incoming>, slot: Option<Arc<RequestSlot>>) -> RequestBody {
        RequestBody {
            inner: Some(inner),
            slot,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut().inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let (Some(slot), Some(inner)) = (self.slot.take(), self.inner.take())
            && !inner.is_end_stream()
            && let Ok(mut rest) = slot.rest.lock()
        {
            *rest = Some(inner);
        }
    }
}

/// An exchange waiting for its response body to finish.
pub struct PendingExchange {
    pub exchange: RawExchange,
    pub request: Arc<RequestSlot>,
    /// Also where the data path's counts go (`CaptureTx::metrics`).
    pub capture: Arc<CaptureTx>,
}

// The response variant is large, but every `Tap` lives in a `Box` already (see `TapBody::tap`): boxing the
// variant too would be one more allocation per exchange to save ~500 bytes on the request side's box.
#[allow(clippy::large_enum_variant)]
enum Finish {
    Request(Arc<RequestSlot>),
    Response(PendingExchange),
}

enum End {
    Complete,
    Error(String),
    Dropped,
}

/// Frames at least this large are kept by reference; smaller ones are copied (see `Tap::keep`).
const SHARE_FRAMES_FROM: usize = 16 * 1024;

pub struct Tap {
    captured: Captured,
    /// Every kept byte is charged here first; when the budget is spent the capture is cut (truncated) and
    /// forwarding goes on.
    budget: Budget,
    /// Copies of small frames, in order, not yet moved into `captured.body`.
    small: bytes::BytesMut,
    cap: usize,
    first_byte_seen: bool,
    /// The length the body announced (`content-length`), when it did.
    expected_len: Option<u64>,
    finish: Finish,
}

impl Tap {
    pub fn request(headers: HeaderList, cap: usize, budget: Budget, slot: Arc<RequestSlot>) -> Tap {
        Tap::new(headers, cap, budget, Finish::Request(slot))
    }

    /// A request tap that goes on from what an earlier one captured (the rest of a body hyper let go of).
    pub fn resume_request(captured: Captured, cap: usize, budget: Budget, slot: Arc<RequestSlot>) -> Tap {
        let mut tap = Tap::new(HeaderList::default(), cap, budget, Finish::Request(slot));
        tap.captured = captured;
        tap
    }

    pub fn response(headers: HeaderList, cap: usize, pending: PendingExchange) -> Tap {
        let budget = pending.capture.budget().clone();
        Tap::new(headers, cap, budget, Finish::Response(pending))
    }

    fn new(headers: HeaderList, cap: usize, budget: Budget, finish: Finish) -> Tap {
        Tap {
            captured: Captured {
                headers,
                ..Captured::default()
            },
            budget,
            small: bytes::BytesMut::new(),
            cap,
            first_byte_seen: false,
            expected_len: None,
            finish,
        }
    }

    /// The body's exact length is known (`content-length`): a small body is copied into one buffer of exactly
    /// that size, so it never grows (copying what it held) and becomes `Bytes` without another allocation.
    fn expect_len(&mut self, len: u64) {
        // A resumed tap has captured some of the body already; `len` is what is left.
        self.expected_len = Some(self.captured.len + len);
        if len < SHARE_FRAMES_FROM as u64 {
            self.small.reserve((len as usize).min(self.cap));
        }
    }

    /// Every byte the body announced has passed. hyper stops polling a body once its announced length is
    /// written, so the end of stream itself may never be seen (an HTTP/2 upstream that ends the stream with a
    /// separate empty frame): the body is still complete.
    fn received_all(&self) -> bool {
        self.expected_len.is_some_and(|len| self.captured.len >= len)
    }

    #[inline]
    fn record(&mut self, data: &Bytes) {
        if !self.first_byte_seen && !data.is_empty() {
            self.first_byte_seen = true;
            if let Finish::Response(p) = &mut self.finish {
                p.exchange.timings.first_byte = Some(now_micros());
            }
        }
        self.captured.len += data.len() as u64;
        if self.captured.truncated {
            return;
        }
        let kept: usize = (self.captured.len as usize).saturating_sub(data.len());
        let room = self.cap.saturating_sub(kept);
        let take = data.len().min(room);
        if take > 0 && !self.budget.reserve(&mut self.captured.charge, take as u64) {
            // Memory for capture is spent (other exchanges in flight or queued): keep the prefix we have.
            self.budget.metrics().capture_over_budget();
            self.captured.truncated = true;
            return;
        }
        if data.len() > room {
            // Keep what fits so the prefix is still useful, then stop copying.
            self.keep(&data.slice(..room));
            self.captured.truncated = true;
        } else {
            self.keep(data);
        }
    }

    /// A `Bytes` from hyper is a slice of its read buffer: holding a clone of a 100-byte SSE frame pins the whole
    /// buffer (kilobytes) until the exchange ends, which made 1,000 long streams cost ~750 MiB. Small frames are
    /// therefore copied into one growing buffer; only large frames, which own most of their buffer, are kept by
    /// reference.
    #[inline]
    fn keep(&mut self, data: &Bytes) {
        if data.len() >= SHARE_FRAMES_FROM {
            self.flush_small();
            self.captured.body.push(data.clone());
        } else {
            self.small.extend_from_slice(data);
        }
    }

    fn flush_small(&mut self) {
        if !self.small.is_empty() {
            // `take`, not `split`: splitting a fresh buffer allocates a shared header for the two halves.
            self.captured.body.push(std::mem::take(&mut self.small).freeze());
        }
    }

    fn finish(mut self, end: End) {
        self.flush_small();
        self.captured.ended = matches!(end, End::Complete);
        match self.finish {
            Finish::Request(slot) => slot.put(self.captured),
            Finish::Response(pending) => {
                let PendingExchange {
                    mut exchange,
                    request,
                    capture,
                } = pending;
                let metrics = capture.metrics();
                exchange.request = request.take();
                exchange.timings.end = now_micros();
                // A request whose end was not captured (the upstream answered before reading all of it, or
                // hyper let go of it early) is a capture with a hole: never reported as complete.
                let truncated = self.captured.truncated || exchange.request.truncated || !exchange.request.ended;
                exchange.outcome = match end {
                    End::Complete if truncated => Outcome::Truncated,
                    End::Complete => Outcome::Complete,
                    End::Error(e) => {
                        metrics.upstream_errors.inc();
                        exchange.error = Some(format!("upstream body error: {e}"));
                        Outcome::UpstreamError
                    }
                    End::Dropped => {
                        metrics.client_gone.inc();
                        Outcome::ClientGone
                    }
                };
                if truncated {
                    metrics.capture_truncated.inc();
                }
                exchange.response = Some(self.captured);
                capture.send_when_idle(exchange);
            }
        }
    }
}

/// A body that is forwarded unchanged and, when `tap` is set, captured on the side.
pub struct TapBody<B> {
    inner: B,
    /// Boxed: hyper's client keeps a 32-slot queue of whole requests per upstream connection, so every byte of
    /// the body type is paid 32 times per pooled connection (an inline tap was ~4.6 KB of each connection's
    /// ~14 KB; 1,000 concurrent streams hold 1,000 connections).
    tap: Option<Box<Tap>>,
    /// The inner body ended; the tap finishes (as complete) when hyper lets go of the body.
    reached_end: bool,
}

impl<B: Body> TapBody<B> {
    pub fn new(inner: B, tap: Option<Tap>) -> TapBody<B> {
        let mut body = TapBody {
            inner,
            tap: tap.map(Box::new),
            reached_end: false,
        };
        if let (Some(tap), Some(len)) = (body.tap.as_mut(), body.inner.size_hint().exact()) {
            tap.expect_len(len);
        }
        // hyper never polls a body that is empty from the start; it has already ended.
        if body.inner.is_end_stream() {
            body.finish(End::Complete);
        }
        body
    }
}

impl<B> TapBody<B> {
    /// The message has no body by definition (HEAD, 1xx, 204, 304): hyper will never poll it.
    pub fn finish_bodiless(&mut self) {
        self.finish(End::Complete);
    }

    fn finish(&mut self, end: End) {
        if let Some(tap) = self.tap.take() {
            tap.finish(end);
        }
    }
}

impl<B> Body for TapBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        let polled = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if this.tap.is_some() {
            match &polled {
                Some(Ok(frame)) => {
                    if let (Some(data), Some(tap)) = (frame.data_ref(), this.tap.as_mut()) {
                        tap.record(data);
                    }
                    // hyper stops polling once the body reports its end (or its announced length is written) and
                    // then drops it. A request's capture is put in its slot now, before hyper has the last frame:
                    // hyper may drop the body only after the upstream has answered (an HTTP/2 upstream's request
                    // body is sent by a task of its own), and the response must find the whole request. A
                    // response remembers that the end was reached and sends the exchange on Drop, after the last
                    // frame is on its way.
                    if this.inner.is_end_stream() || this.tap.as_ref().is_some_and(|t| t.received_all()) {
                        this.reached_end = true;
                        if this
                            .tap
                            .as_ref()
                            .is_some_and(|t| matches!(t.finish, Finish::Request(_)))
                        {
                            this.finish(End::Complete);
                        }
                    }
                }
                Some(Err(e)) => this.finish(End::Error(e.to_string())),
                None => this.finish(End::Complete),
            }
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<B> Drop for TapBody<B> {
    fn drop(&mut self) {
        // Unfinished and not at the end: the consumer (client, or hyper's client for a request) let go early.
        let end = if self.reached_end { End::Complete } else { End::Dropped };
        self.finish(end);
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use http_body_util::Full;

    use super::*;
    use crate::capture::CaptureRx;
    use crate::config::CaptureConfig;
    use crate::telemetry::Metrics;

    const REQUEST: &str = r#"{"model":"m","input":"hi"}"#;

    fn capture() -> (Arc<CaptureTx>, CaptureRx) {
        let (tx, rx) = CaptureTx::channel(&CaptureConfig::default(), Arc::new(Metrics::default()));
        (Arc::new(tx), rx)
    }

    fn poll_once<B: Body<Data = Bytes> + Unpin>(body: &mut TapBody<B>) -> Option<Bytes>
    where
        B::Error: std::fmt::Display,
    {
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(frame))) => frame.into_data().ok(),
            _ => None,
        }
    }

    fn request_body(tx: &CaptureTx, slot: &Arc<RequestSlot>) -> TapBody<Full<Bytes>> {
        let tap = Tap::request(HeaderList::default(), 1 << 20, tx.budget().clone(), slot.clone());
        TapBody::new(Full::new(Bytes::from_static(REQUEST.as_bytes())), Some(tap))
    }

    /// Answers the exchange with a one-frame response body, polled to its end and let go, on a thread that has
    /// never parked (so the exchange is sent at once, see `capture::handoff`).
    fn respond(tx: Arc<CaptureTx>, slot: Arc<RequestSlot>) {
        std::thread::spawn(move || {
            let pending = PendingExchange {
                exchange: RawExchange::for_test(1),
                request: slot,
                capture: tx,
            };
            let tap = Tap::response(HeaderList::default(), 1 << 20, pending);
            let mut body = TapBody::new(Full::new(Bytes::from_static(b"{}")), Some(tap));
            assert!(poll_once(&mut body).is_some());
        })
        .join()
        .expect("response thread");
    }

    /// hyper's HTTP/2 client sends a request body from a task of its own and may drop the body only after the
    /// upstream has answered: the request's capture must be complete once its last frame is handed on.
    #[test]
    fn a_request_is_captured_whole_when_its_last_frame_is_handed_on_before_it_is_dropped() {
        let (tx, mut rx) = capture();
        let slot = Arc::new(RequestSlot::default());
        let mut request = request_body(&tx, &slot);
        assert_eq!(poll_once(&mut request).as_deref(), Some(REQUEST.as_bytes()));
        respond(tx, slot);
        let exchange = rx.drain().pop().expect("the exchange is sent");
        assert_eq!(exchange.request.body_bytes(), REQUEST.as_bytes());
        assert!(exchange.request.ended);
        assert_eq!(exchange.outcome, Outcome::Complete);
        drop(request);
    }

    /// An upstream that answers before the request body has been sent whole: the exchange is kept, marked as
    /// not captured whole.
    #[test]
    fn a_response_that_ends_before_its_request_is_a_truncated_capture() {
        let (tx, mut rx) = capture();
        let slot = Arc::new(RequestSlot::default());
        let request = request_body(&tx, &slot);
        respond(tx.clone(), slot);
        let exchange = rx.drain().pop().expect("the exchange is sent");
        assert!(!exchange.request.ended);
        assert_eq!(exchange.outcome, Outcome::Truncated);
        assert_eq!(tx.metrics().capture_truncated.get(), 1);
        drop(request);
    }
}
