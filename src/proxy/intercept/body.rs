//! The request body as the upstream client gets it. A body the client drops without reading a byte (the
//! upstream could not be reached: refused, TLS failed) goes back to the relay, which reads it through its tap
//! so the trace of the failed exchange keeps the request it carried.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::sync::oneshot;

use super::super::tap::TapBody;

pub struct UpstreamBody {
    inner: Option<TapBody<Incoming>>,
    /// Taken on the first poll: from then on the client owns what it read.
    back: Option<oneshot::Sender<TapBody<Incoming>>>,
}

impl UpstreamBody {
    /// A body that comes back through the returned receiver if it is dropped unread.
    pub fn returnable(inner: TapBody<Incoming>) -> (UpstreamBody, oneshot::Receiver<TapBody<Incoming>>) {
        let (tx, rx) = oneshot::channel();
        (
            UpstreamBody {
                inner: Some(inner),
                back: Some(tx),
            },
            rx,
        )
    }

    pub fn plain(inner: TapBody<Incoming>) -> UpstreamBody {
        UpstreamBody {
            inner: Some(inner),
            back: None,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        this.back = None;
        match this.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.as_ref().map(Body::size_hint).unwrap_or_default()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if let (Some(back), Some(inner)) = (self.back.take(), self.inner.take()) {
            // The relay may have stopped waiting: then the body just ends here.
            let _ = back.send(inner);
        }
    }
}
