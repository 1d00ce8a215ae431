//! A connection whose first bytes must come in time: a client that
//! connects and sends nothing holds a server's slot (or a descriptor) only
//! that long, where a server reads them without a timer (hyper telling
//! HTTP/1 from HTTP/2, tonic's HTTP/2 handshake).

/// The bytes that tell HTTP/2 from HTTP/1 (HTTP/2's client preface).
pub const SNIFFED: usize = 24;

/// HTTP/2's client preface.
const PREFACE: &[u8; SNIFFED] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A connection whose first `left` bytes must come before `deadline`: a
/// client that connects and sends nothing (or a few bytes) gives its slot
/// back, where a server reads them without a timer (hyper telling HTTP/1
/// from HTTP/2, an HTTP/2 server reading the preface). Where the server
/// serves HTTP/1 too ([`FirstBytes::until_http1`]), a byte that is not
/// HTTP/2's preface ends the wait sooner: HTTP/1's own header time applies
/// then, and an HTTP/1.0 request shorter than the preface is not cut off
/// while it is answered.
pub struct FirstBytes<I> {
    io: I,
    left: usize,
    /// Bytes read so far, up to the preface's length.
    seen: usize,
    /// A byte unlike the preface's ends the wait.
    http1: bool,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The listener's place this connection holds, given back with it.
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<I> FirstBytes<I> {
    /// `io`, whose first `left` bytes must come within `within`.
    pub fn new(io: I, left: usize, within: std::time::Duration) -> Self {
        FirstBytes {
            io,
            left,
            seen: 0,
            http1: false,
            deadline: Box::pin(tokio::time::sleep(within)),
            _slot: None,
        }
    }

    /// The wait ends too at the first byte that is not HTTP/2's preface's,
    /// for a server that then serves HTTP/1 under its own header time
    /// (not one that serves HTTP/2 only, which would wait for the rest of
    /// a preface that never comes).
    pub fn until_http1(self) -> Self {
        FirstBytes { http1: true, ..self }
    }

    /// The connection guarded.
    pub fn get_ref(&self) -> &I {
        &self.io
    }

    /// Holds `slot` (one of a listener's bounded places) until the
    /// connection is dropped.
    pub fn holding(self, slot: tokio::sync::OwnedSemaphorePermit) -> Self {
        FirstBytes { _slot: Some(slot), ..self }
    }
}

/// What tonic's server asks of a connection: its addresses, as the stream's.
impl<I: tonic::transport::server::Connected> tonic::transport::server::Connected for FirstBytes<I> {
    type ConnectInfo = I::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<I: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for FirstBytes<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::future::Future;
        let this = &mut *self;
        if this.left > 0 && this.deadline.as_mut().poll(cx).is_ready() {
            let late = std::io::Error::new(std::io::ErrorKind::TimedOut, "no request started in time");
            return std::task::Poll::Ready(Err(late));
        }
        let before = buf.filled().len();
        let read = std::pin::Pin::new(&mut this.io).poll_read(cx, buf);
        if read.is_ready() && this.left > 0 {
            let fresh = &buf.filled()[before..];
            let preface = &PREFACE[this.seen.min(SNIFFED)..];
            let unlike = this.http1 && fresh.iter().zip(preface).any(|(a, b)| a != b);
            this.seen = this.seen.saturating_add(fresh.len());
            this.left = if unlike { 0 } else { this.left.saturating_sub(fresh.len()) };
        }
        read
    }
}

impl<I: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for FirstBytes<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What reading `sent` through the guard gives once its deadline has
    /// passed: the bytes, or the guard's error.
    async fn read_after_deadline(sent: &[u8], http1: bool) -> std::io::Result<Vec<u8>> {
        let (mut client, server) = tokio::io::duplex(256);
        let mut guarded = FirstBytes::new(server, SNIFFED, std::time::Duration::from_millis(20));
        if http1 {
            guarded = guarded.until_http1();
        }
        client.write_all(sent).await.unwrap();
        let mut got = vec![0u8; sent.len()];
        guarded.read_exact(&mut got).await?;
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
        client.write_all(b"more").await.unwrap();
        let mut more = [0u8; 4];
        guarded.read_exact(&mut more).await?;
        got.extend_from_slice(&more);
        Ok(got)
    }

    /// The start of HTTP/2's preface, then silence past the deadline: cut
    /// off. Where HTTP/1 is served, an HTTP/1.0 request shorter than the
    /// preface tells the versions apart at once: never cut off after; where
    /// HTTP/2 alone is, it is (its server would wait for the rest).
    #[test]
    fn a_connection_is_cut_off_only_while_it_may_still_be_starting_http2() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            for http1 in [true, false] {
                let e = read_after_deadline(b"PRI * HTTP", http1).await.unwrap_err();
                assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
                let whole = read_after_deadline(PREFACE, http1).await.unwrap();
                assert_eq!(whole.len(), SNIFFED + 4);
            }
            let short = b"GET / HTTP/1.0\r\n\r\n";
            assert_eq!(read_after_deadline(short, true).await.unwrap(), [&short[..], b"more"].concat());
            let e = read_after_deadline(short, false).await.unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        });
    }
}
