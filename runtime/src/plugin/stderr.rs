//! A guest's stderr, captured in a bounded buffer: the host forwards it to
//! the log after each call and attaches it to the error a trap produces (a
//! Rust guest's panic message arrives this way).

use bytes::Bytes;
use std::{
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// Keeps the last `capacity` bytes written; writing never fails, so a chatty
/// plugin cannot trap itself by filling the buffer.
#[derive(Clone)]
pub struct CapturedStderr {
    buf: Arc<Mutex<Vec<u8>>>,
    /// Set by writes, so that checking after every call costs one load.
    written: Arc<AtomicBool>,
    /// Bytes dropped from the front since the last `take`.
    dropped: Arc<std::sync::atomic::AtomicUsize>,
    capacity: usize,
}

impl CapturedStderr {
    pub fn new(capacity: usize) -> Self {
        CapturedStderr {
            buf: Arc::new(Mutex::new(Vec::new())),
            written: Arc::new(AtomicBool::new(false)),
            dropped: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            capacity: capacity.max(1),
        }
    }

    fn push(&self, bytes: &[u8]) {
        let mut buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        buf.extend_from_slice(bytes);
        if buf.len() > self.capacity {
            let excess = buf.len() - self.capacity;
            buf.drain(..excess);
            self.dropped.fetch_add(excess, Ordering::Relaxed);
        }
        self.written.store(true, Ordering::Release);
    }

    /// Takes what was written so far (lossy UTF-8), leaving the buffer empty;
    /// when the buffer overflowed, the text starts with a line saying how
    /// many bytes were dropped.
    pub fn take(&self) -> Option<String> {
        if !self.written.swap(false, Ordering::Acquire) {
            return None;
        }
        let mut buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        if buf.is_empty() {
            return None;
        }
        let dropped = self.dropped.swap(0, Ordering::Relaxed);
        let mut text = String::from_utf8_lossy(&buf).into_owned();
        if dropped > 0 {
            text =
                format!("[{dropped} earlier bytes of stderr dropped; the last {} kept]\n{text}", buf.len());
        }
        buf.clear();
        Some(text)
    }
}

impl IsTerminal for CapturedStderr {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for CapturedStderr {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for CapturedStderr {
    async fn ready(&mut self) {}
}

impl OutputStream for CapturedStderr {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(64 * 1024)
    }
}

impl tokio::io::AsyncWrite for CapturedStderr {
    fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_only_the_tail() {
        let s = CapturedStderr::new(8);
        s.push(b"0123456789");
        s.push(b"ab");
        assert_eq!(
            s.take().as_deref(),
            Some("[4 earlier bytes of stderr dropped; the last 8 kept]\n456789ab")
        );
        assert_eq!(s.take(), None);
        s.push(b"xy");
        assert_eq!(s.take().as_deref(), Some("xy"));
    }
}
