//! A TCP proxy that puts network faults between a client and one upstream server.
//!
//! [`FaultProxy::start`] listens on an ephemeral port of 127.0.0.1 and forwards every
//! connection to the upstream address. Through a cloneable [`FaultHandle`] a test changes,
//! at run time, what the link does:
//!
//! | call | models |
//! |---|---|
//! | [`latency`](FaultHandle::latency) | a long or congested path: bytes arrive late, in order |
//! | [`throttle`](FaultHandle::throttle) | a thin pipe: at most N bytes/s per connection and direction |
//! | [`cut`](FaultHandle::cut) | the server or a firewall resetting: every connection gets a RST, new ones too |
//! | [`blackhole`](FaultHandle::blackhole) | a partition: nothing moves either way, nobody is told |
//! | [`blackhole_existing`](FaultHandle::blackhole_existing) | a firewall or NAT that forgot its flows: open connections go silent, new ones work |
//! | [`half_open`](FaultHandle::half_open) | one direction lost: its bytes vanish, the other still flows |
//! | [`heal`](FaultHandle::heal) | the network back to normal |
//!
//! Each connection is two pumps (client → upstream, upstream → client). A pump reads into
//! a small queue, stamping each chunk with the time it was read, and a writer takes chunks
//! out only when the current faults let them go; so a fault applies to bytes already inside
//! the proxy too, as it would to segments already on the wire.
//!
//! The faults live above TCP: the proxy's kernel still acknowledges every segment and
//! answers keepalive probes, so a client's TCP keepalives and `TCP_USER_TIMEOUT` do not
//! notice a blackhole here (on a real network they might). What the proxy tests is whether
//! the application notices by itself, through its own timeouts and heartbeats.

use std::io;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

/// Which way a fault applies, seen from the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Client → upstream (requests, publishes).
    ToUpstream,
    /// Upstream → client (replies, acks).
    ToClient,
    Both,
}

impl Direction {
    fn includes(self, one: Direction) -> bool {
        self == Direction::Both || self == one
    }
}

/// The faults of one direction of the link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkFaults {
    /// Added to every chunk's delivery time.
    pub latency: Duration,
    /// At most this many bytes per second per connection; `None` is unlimited.
    pub bytes_per_sec: Option<u64>,
    /// Blackholed: bytes wait inside the proxy (and then in the kernel's buffers) until healed.
    pub held: bool,
    /// Half-open: bytes are read and thrown away.
    pub dropped: bool,
}

/// Everything the proxy currently does to its traffic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub to_upstream: LinkFaults,
    pub to_client: LinkFaults,
    /// Set by [`FaultHandle::cut`]: new connections are reset at once until healed.
    pub refusing: bool,
    /// How many cuts so far; a connection that sees it change resets itself.
    cuts: u64,
    /// Connections numbered up to this one are held both ways (0: none).
    stale_upto: u64,
}

impl Faults {
    /// The faults that apply to connection number `serial` going `direction`.
    fn link(&self, direction: Direction, serial: u64) -> LinkFaults {
        let mut link = match direction {
            Direction::ToClient => self.to_client,
            _ => self.to_upstream,
        };
        link.held |= serial <= self.stale_upto;
        link
    }

    fn links_mut(&mut self, direction: Direction) -> impl Iterator<Item = &mut LinkFaults> {
        let up = direction
            .includes(Direction::ToUpstream)
            .then_some(&mut self.to_upstream);
        let down = direction
            .includes(Direction::ToClient)
            .then_some(&mut self.to_client);
        up.into_iter().chain(down)
    }
}

struct Shared {
    faults: watch::Sender<Faults>,
    live: AtomicUsize,
    /// The number of the last connection accepted (connections count from 1).
    serials: AtomicU64,
}

/// Changes a running [`FaultProxy`]'s faults; clones control the same proxy.
#[derive(Clone)]
pub struct FaultHandle {
    shared: Arc<Shared>,
}

impl FaultHandle {
    /// Delays every byte going `direction` by `latency` (replacing an earlier setting). The
    /// delay counts from when the proxy read the byte, and a shorter setting (or [`heal`])
    /// releases bytes already waiting.
    ///
    /// [`heal`]: FaultHandle::heal
    pub fn latency(&self, direction: Direction, latency: Duration) {
        self.modify(|f| f.links_mut(direction).for_each(|l| l.latency = latency));
    }

    /// Limits each connection to `bytes_per_sec` going `direction` (`None`: no limit).
    pub fn throttle(&self, direction: Direction, bytes_per_sec: Option<u64>) {
        self.modify(|f| {
            f.links_mut(direction)
                .for_each(|l| l.bytes_per_sec = bytes_per_sec)
        });
    }

    /// Resets every open connection (both sides get a RST, bytes in flight are lost) and
    /// resets new connections as soon as they are accepted, until [`heal`](Self::heal): the
    /// server is gone, or a firewall rejects the flow. `cut(); heal();` is a one-off reset
    /// of the current connections.
    pub fn cut(&self) {
        self.modify(|f| {
            f.cuts += 1;
            f.refusing = true;
        });
    }

    /// [`cut`](Self::cut), returning once no connection is open through the proxy. Each
    /// connection resets itself a moment after the cut, and what a client writes meanwhile
    /// still passes: a test that writes right after a bare cut may see it delivered.
    pub async fn cut_and_wait(&self) {
        self.cut();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while self.connections() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} connection(s) still open 30 s after a cut",
                self.connections()
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Stops all traffic both ways without closing anything: a network partition. Peers see
    /// no error, no EOF, no RST; data just stops. New connections are accepted but not
    /// connected upstream until healed (as a SYN would be retransmitted through a
    /// partition). Nothing is lost: like TCP retransmitting after a partition heals, the
    /// held bytes arrive once [`heal`](Self::heal) is called.
    pub fn blackhole(&self) {
        self.modify(|f| f.links_mut(Direction::Both).for_each(|l| l.held = true));
    }

    /// Holds the connections open now, both ways, as [`blackhole`](Self::blackhole) does,
    /// while connections made from now on work: a stateful firewall, NAT or load balancer
    /// that lost its flow table (or failed over) and drops the old flows' packets without a
    /// RST. Only a client that gives up on a silent connection, by a timeout or keepalive,
    /// gets going again before [`heal`](Self::heal).
    pub fn blackhole_existing(&self) {
        let newest = self.shared.serials.load(Ordering::SeqCst);
        self.modify(|f| f.stale_upto = newest);
    }

    /// Silently drops the bytes going `dropped` while the other direction keeps flowing: a
    /// half-open connection (a peer that lost the connection's state, a NAT entry gone one
    /// way). The sender sees neither error nor back-pressure. A connection that lost bytes
    /// has a hole in its stream and cannot resume, so [`heal`](Self::heal) resets it, as the
    /// peer's RST eventually would; connections that lost nothing carry on.
    pub fn half_open(&self, dropped: Direction) {
        self.modify(|f| f.links_mut(dropped).for_each(|l| l.dropped = true));
    }

    /// Removes every fault: no latency, no limit, nothing held, dropped or refused.
    /// Connections already reset stay closed.
    pub fn heal(&self) {
        self.modify(|f| {
            *f = Faults {
                cuts: f.cuts,
                ..Faults::default()
            }
        });
    }

    /// The faults in force.
    pub fn faults(&self) -> Faults {
        self.shared.faults.borrow().clone()
    }

    /// Connections open through the proxy right now (accepted and not yet closed).
    pub fn connections(&self) -> usize {
        self.shared.live.load(Ordering::SeqCst)
    }

    fn modify(&self, change: impl FnOnce(&mut Faults)) {
        self.shared.faults.send_modify(change);
    }
}

/// A running proxy; dropping it closes the listener and every connection through it.
/// It derefs to its [`FaultHandle`].
pub struct FaultProxy {
    addr: SocketAddr,
    handle: FaultHandle,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on 127.0.0.1 (ephemeral port) in front of `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> io::Result<FaultProxy> {
        let upstream = tokio::net::lookup_host(upstream)
            .await?
            .next()
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "upstream has no address")
            })?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let handle = FaultHandle {
            shared: Arc::new(Shared {
                faults: watch::Sender::new(Faults::default()),
                live: AtomicUsize::new(0),
                serials: AtomicU64::new(0),
            }),
        };
        let accept = tokio::spawn(accept_loop(listener, upstream, handle.clone()));
        Ok(FaultProxy {
            addr,
            handle,
            accept,
        })
    }

    /// Starts a proxy in front of the server a URL such as `postgres://u@host:port/db` or
    /// `nats://host:port` names, and returns it with the same URL pointing at the proxy.
    pub async fn start_for_url(url: &str) -> io::Result<(FaultProxy, String)> {
        let invalid = || io::Error::new(io::ErrorKind::InvalidInput, "URL without host:port");
        let (scheme, rest) = url.split_once("://").ok_or_else(invalid)?;
        let end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, host_port) = match authority.rsplit_once('@') {
            Some((user, hp)) => (format!("{user}@"), hp),
            None => (String::new(), authority),
        };
        if !host_port.contains(':') {
            return Err(invalid());
        }
        let proxy = FaultProxy::start(host_port).await?;
        let proxied = format!("{scheme}://{userinfo}{}{tail}", proxy.addr);
        Ok((proxy, proxied))
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// A handle that outlives borrows of the proxy (for tasks).
    pub fn handle(&self) -> FaultHandle {
        self.handle.clone()
    }
}

impl Deref for FaultProxy {
    type Target = FaultHandle;

    fn deref(&self) -> &FaultHandle {
        &self.handle
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // The accept task owns the connections' JoinSet: aborting it aborts them all.
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, handle: FaultHandle) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    connections.spawn(serve(client, upstream, handle.clone()));
                }
                // Out of file descriptors and the like: back off instead of spinning.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next() => {}
        }
    }
}

/// Closes with a RST rather than a FIN once `stream` is dropped.
fn reset(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

/// Counts a connection as live while it exists.
struct Live<'a>(&'a AtomicUsize);

impl<'a> Live<'a> {
    fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Live(counter)
    }
}

impl Drop for Live<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn serve(mut client: TcpStream, upstream: SocketAddr, handle: FaultHandle) {
    let _live = Live::new(&handle.shared.live);
    let serial = handle.shared.serials.fetch_add(1, Ordering::SeqCst) + 1;
    let mut faults = handle.shared.faults.subscribe();
    // Read together, so a cut lands either before this connection (refused) or after it.
    let (generation, refusing) = {
        let now = faults.borrow();
        (now.cuts, now.refusing)
    };
    if refusing {
        return reset(&client);
    }
    let connect = async {
        // A partition holds the handshake too: connect upstream only once traffic may flow.
        let _ = faults
            .wait_for(|f| !f.to_upstream.held && !f.to_client.held)
            .await;
        TcpStream::connect(upstream).await
    };
    let mut server = tokio::select! {
        connected = connect => match connected {
            Ok(server) => server,
            // Upstream refused: so does the proxy.
            Err(_) => return reset(&client),
        },
        () = cut_after(handle.shared.faults.subscribe(), generation) => return reset(&client),
    };
    // Nagle would add its own delays to small writes; the faults are the only ones wanted.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let outcome = tokio::select! {
        outcome = forward(&mut client, &mut server, serial, &handle) => outcome,
        () = cut_after(handle.shared.faults.subscribe(), generation) => Err(io::ErrorKind::ConnectionReset.into()),
    };
    if outcome.is_err() {
        // One side failed, was cut or lost bytes: the other side must not see a clean end.
        reset(&client);
        reset(&server);
    }
}

/// Returns once a cut newer than `generation` happens (never, if the proxy is gone).
async fn cut_after(mut faults: watch::Receiver<Faults>, generation: u64) {
    if faults.wait_for(|f| f.cuts != generation).await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn forward(
    client: &mut TcpStream,
    server: &mut TcpStream,
    serial: u64,
    handle: &FaultHandle,
) -> io::Result<()> {
    let (client_read, client_write) = client.split();
    let (server_read, server_write) = server.split();
    let faults = &handle.shared.faults;
    tokio::try_join!(
        pump(
            client_read,
            server_write,
            Link(Direction::ToUpstream, serial),
            faults.subscribe()
        ),
        pump(
            server_read,
            client_write,
            Link(Direction::ToClient, serial),
            faults.subscribe()
        ),
    )?;
    Ok(())
}

/// What a pump read: bytes, the end of the stream, or a read error (a RST from the peer),
/// stamped with when it was read. Ends and errors queue behind the bytes before them.
struct Chunk {
    read_at: Instant,
    piece: Piece,
}

enum Piece {
    Bytes(Vec<u8>),
    End,
    Failed(io::Error),
}

/// One direction of one connection (by its number), the unit faults apply to.
#[derive(Clone, Copy)]
struct Link(Direction, u64);

impl Link {
    fn of(self, faults: &Faults) -> LinkFaults {
        faults.link(self.0, self.1)
    }
}

/// Copies one direction through the faults until the reading side ends.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    to: impl AsyncWrite + Unpin,
    link: Link,
    faults: watch::Receiver<Faults>,
) -> io::Result<()> {
    // A few chunks of slack between reading and writing: what a link holds in flight. The
    // rest waits in the sender's socket buffer, as unacknowledged data would.
    let (queue, chunks) = mpsc::channel(8);
    let read = async move {
        let mut buf = vec![0; 16 * 1024];
        loop {
            let piece = match from.read(&mut buf).await {
                Ok(0) => Piece::End,
                Ok(n) => Piece::Bytes(buf[..n].to_vec()),
                Err(e) => Piece::Failed(e),
            };
            let last = !matches!(piece, Piece::Bytes(_));
            let chunk = Chunk {
                read_at: Instant::now(),
                piece,
            };
            if queue.send(chunk).await.is_err() || last {
                return;
            }
        }
    };
    let write = deliver(chunks, to, link, faults);
    tokio::pin!(write);
    tokio::select! {
        outcome = &mut write => return outcome,
        () = read => {}
    }
    // The reading side ended; what it read still goes out.
    write.await
}

/// What the faults let a chunk do once it may leave.
enum Gate {
    Send,
    Drop,
}

async fn deliver(
    mut chunks: mpsc::Receiver<Chunk>,
    mut to: impl AsyncWrite + Unpin,
    link: Link,
    mut faults: watch::Receiver<Faults>,
) -> io::Result<()> {
    let hole = || io::Error::new(io::ErrorKind::ConnectionAborted, "bytes were dropped");
    let mut lost = false;
    loop {
        let next = if lost {
            // The stream has a hole: once this direction stops dropping, reset the connection.
            tokio::select! {
                next = chunks.recv() => next,
                _ = faults.wait_for(|f| !link.of(f).dropped) => return Err(hole()),
            }
        } else {
            chunks.recv().await
        };
        let Some(chunk) = next else {
            return Ok(());
        };
        match gate(&mut faults, link, chunk.read_at).await {
            Gate::Drop => {
                lost = true;
                continue;
            }
            Gate::Send if lost => return Err(hole()),
            Gate::Send => {}
        }
        match chunk.piece {
            Piece::Bytes(bytes) => write_paced(&mut to, &bytes, link, &faults).await?,
            Piece::End => to.shutdown().await?,
            Piece::Failed(e) => return Err(e),
        }
    }
}

/// Waits until a chunk read at `read_at` may go: not held, its latency served.
async fn gate(faults: &mut watch::Receiver<Faults>, link: Link, read_at: Instant) -> Gate {
    loop {
        let now = link.of(&faults.borrow_and_update());
        if now.dropped {
            return Gate::Drop;
        }
        let due = read_at + now.latency;
        if !now.held && Instant::now() >= due {
            return Gate::Send;
        }
        // Re-check on any change: a heal releases held and delayed bytes at once.
        tokio::select! {
            changed = faults.changed() => if changed.is_err() { return Gate::Send },
            () = tokio::time::sleep_until(due), if !now.held => {}
        }
    }
}

/// Writes `bytes`, in slices of a twentieth of a second's worth when throttled so the flow
/// is steady rather than bursty.
async fn write_paced(
    to: &mut (impl AsyncWrite + Unpin),
    mut bytes: &[u8],
    link: Link,
    faults: &watch::Receiver<Faults>,
) -> io::Result<()> {
    while !bytes.is_empty() {
        let limit = link.of(&faults.borrow()).bytes_per_sec;
        let Some(rate) = limit.map(|r| r.max(1)) else {
            return to.write_all(bytes).await;
        };
        let n = bytes.len().min((rate / 20).max(1) as usize);
        to.write_all(&bytes[..n]).await?;
        bytes = &bytes[n..];
        tokio::time::sleep(Duration::from_secs_f64(n as f64 / rate as f64)).await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the echo server saw.
    #[derive(Debug, PartialEq)]
    enum Seen {
        Accepted,
        Bytes(Vec<u8>),
    }

    /// An echo server on 127.0.0.1 that reports what it accepts and reads.
    async fn echo_server() -> (SocketAddr, mpsc::UnboundedReceiver<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (report, seen) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let report = report.clone();
                let _ = report.send(Seen::Accepted);
                tokio::spawn(async move {
                    let mut buf = vec![0; 64 * 1024];
                    loop {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                let _ = report.send(Seen::Bytes(buf[..n].to_vec()));
                                if stream.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    // Echo the end of stream too.
                    let _ = stream.shutdown().await;
                });
            }
        });
        (addr, seen)
    }

    async fn proxied_echo() -> (FaultProxy, mpsc::UnboundedReceiver<Seen>) {
        let (addr, seen) = echo_server().await;
        let proxy = FaultProxy::start(&addr.to_string()).await.unwrap();
        (proxy, seen)
    }

    async fn read_exactly(stream: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0; n];
        stream.read_exact(&mut buf).await.unwrap();
        buf
    }

    /// Connects and checks one round trip, and that the echo server saw the connection.
    async fn connected(proxy: &FaultProxy, seen: &mut mpsc::UnboundedReceiver<Seen>) -> TcpStream {
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        stream.write_all(b"ping").await.unwrap();
        assert_eq!(read_exactly(&mut stream, 4).await, b"ping");
        assert_eq!(seen.recv().await, Some(Seen::Accepted));
        assert_eq!(seen.recv().await, Some(Seen::Bytes(b"ping".to_vec())));
        stream
    }

    /// Long enough that a byte the proxy let through would have arrived; short for a test.
    const QUIET: Duration = Duration::from_millis(500);

    async fn nothing_arrives(stream: &mut TcpStream) {
        let mut buf = [0; 1];
        let read = tokio::time::timeout(QUIET, stream.read(&mut buf)).await;
        assert!(read.is_err(), "expected silence, got {read:?}");
    }

    async fn server_sees_nothing(seen: &mut mpsc::UnboundedReceiver<Seen>) {
        let got = tokio::time::timeout(QUIET, seen.recv()).await;
        assert!(got.is_err(), "upstream got {got:?}");
    }

    async fn is_reset(stream: &mut TcpStream) {
        let mut buf = [0; 16];
        let read = stream.read(&mut buf).await;
        assert!(
            matches!(&read, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "expected a reset, got {read:?}"
        );
    }

    #[tokio::test]
    async fn forwards_both_ways_and_passes_on_the_end_of_stream() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;
        assert_eq!(proxy.connections(), 1);
        let big: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        let (mut read, mut write) = stream.split();
        let (_, echoed) = tokio::join!(write.write_all(&big), async {
            let mut echoed = vec![0; big.len()];
            read.read_exact(&mut echoed).await.unwrap();
            echoed
        });
        assert_eq!(echoed, big);
        stream.shutdown().await.unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        crate::eventually("the proxy to forget the connection", QUIET * 10, || {
            let n = proxy.connections();
            async move { (n == 0).then_some(()) }
        })
        .await;
    }

    #[tokio::test]
    async fn latency_delays_bytes_and_heal_releases_them() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;

        let latency = Duration::from_millis(150);
        proxy.latency(Direction::Both, latency);
        let started = Instant::now();
        stream.write_all(b"slow").await.unwrap();
        assert_eq!(read_exactly(&mut stream, 4).await, b"slow");
        assert_eq!(seen.recv().await, Some(Seen::Bytes(b"slow".to_vec())));
        // A lower bound only: the proxy never delivers early, however loaded the machine.
        assert!(started.elapsed() >= 2 * latency);

        proxy.latency(Direction::ToUpstream, Duration::from_secs(3600));
        stream.write_all(b"late").await.unwrap();
        server_sees_nothing(&mut seen).await;
        proxy.heal();
        assert_eq!(read_exactly(&mut stream, 4).await, b"late");
    }

    #[tokio::test]
    async fn throttle_paces_each_direction() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;
        let rate = 40_000;
        proxy.throttle(Direction::ToClient, Some(rate));
        let data = vec![7u8; 20_000];
        let started = Instant::now();
        stream.write_all(&data).await.unwrap();
        assert_eq!(read_exactly(&mut stream, data.len()).await, data);
        // Ten slices of 2,000 bytes, each followed by 50 ms: nine pauses come before the last
        // byte. A lower bound again.
        assert!(started.elapsed() >= Duration::from_millis(9 * 50));
        assert_eq!(proxy.faults().to_client.bytes_per_sec, Some(rate));
        assert_eq!(proxy.faults().to_upstream.bytes_per_sec, None);
    }

    #[tokio::test]
    async fn cut_resets_connections_and_refuses_new_ones_until_healed() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;
        proxy.cut();
        is_reset(&mut stream).await;

        // The listener still accepts (as a firewall's RST answers a SYN), then resets.
        let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
        is_reset(&mut refused).await;

        proxy.heal();
        connected(&proxy, &mut seen).await;
    }

    #[tokio::test]
    async fn blackhole_stalls_without_closing_and_heal_delivers_what_was_held() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;
        proxy.blackhole();
        stream.write_all(b"held").await.unwrap();
        nothing_arrives(&mut stream).await;
        server_sees_nothing(&mut seen).await;

        // A new connection is accepted but not connected upstream.
        let mut late = TcpStream::connect(proxy.addr()).await.unwrap();
        late.write_all(b"new").await.unwrap();
        nothing_arrives(&mut late).await;
        server_sees_nothing(&mut seen).await;
        crate::eventually("the proxy to hold two connections", QUIET * 10, || {
            let n = proxy.connections();
            async move { (n == 2).then_some(()) }
        })
        .await;

        proxy.heal();
        assert_eq!(read_exactly(&mut stream, 4).await, b"held");
        assert_eq!(read_exactly(&mut late, 3).await, b"new");
    }

    #[tokio::test]
    async fn blackhole_existing_stalls_open_connections_only() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut old = connected(&proxy, &mut seen).await;
        proxy.blackhole_existing();
        old.write_all(b"old").await.unwrap();
        nothing_arrives(&mut old).await;
        server_sees_nothing(&mut seen).await;

        connected(&proxy, &mut seen).await;

        proxy.heal();
        assert_eq!(read_exactly(&mut old, 3).await, b"old");
    }

    #[tokio::test]
    async fn half_open_drops_one_direction_and_heal_resets_what_lost_bytes() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;
        proxy.half_open(Direction::ToClient);
        stream.write_all(b"lost").await.unwrap();
        // The request goes through; the reply vanishes.
        assert_eq!(seen.recv().await, Some(Seen::Bytes(b"lost".to_vec())));
        nothing_arrives(&mut stream).await;
        proxy.heal();
        is_reset(&mut stream).await;

        let mut stream = connected(&proxy, &mut seen).await;
        proxy.half_open(Direction::ToUpstream);
        stream.write_all(b"gone").await.unwrap();
        server_sees_nothing(&mut seen).await;
        nothing_arrives(&mut stream).await;
        proxy.heal();
        is_reset(&mut stream).await;
    }

    #[tokio::test]
    async fn a_connection_that_lost_nothing_survives_a_half_open_spell() {
        let (proxy, mut seen) = proxied_echo().await;
        let mut stream = connected(&proxy, &mut seen).await;
        proxy.half_open(Direction::ToClient);
        proxy.heal();
        stream.write_all(b"fine").await.unwrap();
        assert_eq!(read_exactly(&mut stream, 4).await, b"fine");
    }

    #[tokio::test]
    async fn postgres_stalls_while_blackholed_and_fails_when_cut() {
        let (proxy, url) = FaultProxy::start_for_url(&crate::pg_admin_url())
            .await
            .unwrap();
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let one = |row: tokio_postgres::Row| row.get::<_, i32>(0);
        assert_eq!(one(client.query_one("SELECT 1", &[]).await.unwrap()), 1);

        proxy.blackhole();
        let stalled = client.query_one("SELECT 2", &[]);
        tokio::pin!(stalled);
        assert!(
            tokio::time::timeout(Duration::from_secs(2), &mut stalled)
                .await
                .is_err(),
            "a query through a blackhole does not finish"
        );
        assert!(!client.is_closed(), "nobody told the client anything");
        let connecting = tokio_postgres::connect(&url, tokio_postgres::NoTls);
        assert!(
            tokio::time::timeout(Duration::from_secs(2), connecting)
                .await
                .is_err(),
            "a new connection does not get through either"
        );
        proxy.heal();
        // The partition healed before anyone gave up: the held query completes.
        assert_eq!(one(stalled.await.unwrap()), 2);

        proxy.cut();
        let error = client.query_one("SELECT 3", &[]).await.unwrap_err();
        assert!(client.is_closed(), "{error}");
        assert!(tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .is_err());
        proxy.heal();
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        assert_eq!(one(client.query_one("SELECT 4", &[]).await.unwrap()), 4);
    }

    #[tokio::test]
    async fn start_for_url_keeps_everything_but_the_address() {
        let (addr, _seen) = echo_server().await;
        let url = format!("postgres://user:pw@{addr}/db?sslmode=disable");
        let (proxy, proxied) = FaultProxy::start_for_url(&url).await.unwrap();
        assert_eq!(
            proxied,
            format!(
                "postgres://user:pw@127.0.0.1:{}/db?sslmode=disable",
                proxy.port()
            )
        );
        let (proxy, proxied) = FaultProxy::start_for_url(&format!("nats://{addr}"))
            .await
            .unwrap();
        assert_eq!(proxied, format!("nats://127.0.0.1:{}", proxy.port()));
        assert!(FaultProxy::start_for_url("sqlite:x.db").await.is_err());
    }
}
