//! A connection whose first bytes must come in time: a client that
//! connects and sends nothing holds a server's slot (or a descriptor) only
//! that long, where a server reads them without a timer (hyper telling
//! HTTP/1 from HTTP/2, tonic's HTTP/2 handshake).

/// The bytes that tell HTTP/2 from HTTP/1 (HTTP/2's client preface).
pub const SNIFFED: usize = 24;

/// A connection whose first `left` bytes must come before `deadline`: a
/// client that connects and sends nothing (or a few bytes) gives its slot
/// back, where hyper reads what tells the versions apart without a timer.
pub struct FirstBytes<I> {
    io: I,
    left: usize,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
    /// The listener's place this connection holds, given back with it.
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<I> FirstBytes<I> {
    /// `io`, whose first `left` bytes must come within `within`.
    pub fn new(io: I, left: usize, within: std::time::Duration) -> Self {
        FirstBytes { io, left, deadline: Box::pin(tokio::time::sleep(within)), _slot: None }
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
        if read.is_ready() {
            this.left = this.left.saturating_sub(buf.filled().len() - before);
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
