//! Server streams that cannot pin llmtap's resources: their number is bounded, and a client that stops taking
//! messages is dropped after the stall timeout instead of parking its producer (and, for exports, a blocking
//! thread) forever.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tonic::Status;

use crate::telemetry::Metrics;

/// The `[api] max_streams` bound on concurrent Subscribe and Export streams.
#[derive(Clone)]
pub struct StreamLimit {
    slots: Arc<Semaphore>,
    max: usize,
    stall_timeout: Duration,
    metrics: Arc<Metrics>,
}

impl StreamLimit {
    pub fn new(max: usize, stall_timeout: Duration, metrics: Arc<Metrics>) -> StreamLimit {
        StreamLimit {
            slots: Arc::new(Semaphore::new(max)),
            max,
            stall_timeout,
            metrics,
        }
    }

    /// A new stream, or RESOURCE_EXHAUSTED when `max` are open. `buffer` is the channel's capacity in messages.
    pub fn open<T>(&self, buffer: usize) -> Result<(Feed<T>, FedStream<T>), Status> {
        let Ok(permit) = self.slots.clone().try_acquire_owned() else {
            self.metrics.api_streams_rejected.inc();
            return Err(Status::resource_exhausted(format!(
                "llmtap API: {} streams are open already ([api] max_streams); try again later",
                self.max
            )));
        };
        self.metrics.api_streams.add(1);
        let (tx, rx) = mpsc::channel(buffer);
        let end = Arc::new(OnceLock::new());
        let feed = Feed {
            tx,
            end: end.clone(),
            stall_timeout: self.stall_timeout,
            _slot: Slot {
                _permit: permit,
                metrics: self.metrics.clone(),
            },
        };
        Ok((feed, FedStream { rx, end, ended: false }))
    }
}

/// Holds a stream's place in the limit until its producer is done.
struct Slot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.api_streams.sub(1);
    }
}

/// Why a message could not be handed to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FeedError {
    #[error("the API client went away")]
    ClientGone,
    #[error("the API client took nothing within the stall timeout; stream dropped")]
    Stalled,
}

/// The producer's end of a stream.
pub struct Feed<T> {
    tx: mpsc::Sender<Result<T, Status>>,
    end: Arc<OnceLock<Status>>,
    stall_timeout: Duration,
    _slot: Slot,
}

impl<T> Feed<T> {
    /// Hand on one message, waiting at most the stall timeout for the client to make room. On a stall the
    /// stream is ended with DEADLINE_EXCEEDED (what is still buffered is discarded) and the caller must stop.
    pub async fn send(&self, item: Result<T, Status>, metrics: &Metrics) -> Result<(), FeedError> {
        match tokio::time::timeout(self.stall_timeout, self.tx.send(item)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(FeedError::ClientGone),
            Err(_) => {
                metrics.api_streams_stalled.inc();
                let _ = self.end.set(Status::deadline_exceeded(format!(
                    "llmtap API: stream dropped, the client took nothing for {} s ([api] stall_timeout_secs)",
                    self.stall_timeout.as_secs()
                )));
                Err(FeedError::Stalled)
            }
        }
    }

    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.tx.closed().await
    }
}

/// The stream tonic sends: the producer's messages, or the status it ended the stream with.
pub struct FedStream<T> {
    rx: mpsc::Receiver<Result<T, Status>>,
    end: Arc<OnceLock<Status>>,
    ended: bool,
}

impl<T> futures_core::Stream for FedStream<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        // A stream ended for a stall says so first: the data buffered behind it is stale and dropped.
        if let Some(status) = self.end.get() {
            let status = status.clone();
            self.ended = true;
            self.rx.close();
            return Poll::Ready(Some(Err(status)));
        }
        self.rx.poll_recv(cx)
    }
}
