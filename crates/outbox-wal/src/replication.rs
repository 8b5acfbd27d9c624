//! PostgreSQL's streaming replication protocol, as much as WAL capture needs: a connection in
//! `replication=database` mode (TLS with the store's `sslmode` meanings; password, md5 or
//! SCRAM-SHA-256), simple queries for the slot, and one `START_REPLICATION` stream.
//!
//! Everything the server sends is read into one buffer, in reads as large as the socket
//! has ready: a burst of small messages costs one read (and, under TLS, one decryption
//! pass), not two reads per message, and the messages are handed out as slices of that
//! buffer. The stream is read by its caller's task, with no task or queue in between, and
//! it answers the server (status updates, keepalive replies) from the same calls.

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::{Buf, Bytes, BytesMut};
use postgres_protocol::authentication::sasl::{
    ChannelBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::lsn::Lsn;

/// Why the connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("io error: {0}")]
    Io(#[from] std::io::Error),
    /// An ErrorResponse: `message (SQLSTATE code)`.
    #[error("{message} (SQLSTATE {code})")]
    Server { code: String, message: String },
    #[error("TLS: {0}")]
    Tls(String),
    /// What the client cannot do (an authentication method) or a message it cannot read.
    #[error("{0}")]
    Protocol(String),
    /// None of the URL's hosts is a primary a session can stream from: each host's reason.
    /// A failover may be under way, so a new session may find one.
    #[error(
        "no primary among the database URL's hosts ({0}): WAL capture streams from the primary"
    )]
    NoPrimary(String),
}

impl ConnectionError {
    /// The server's SQLSTATE, for an error it sent.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            ConnectionError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Whether a new connection may succeed where this one failed: it broke or could not
    /// be made, no host was a primary yet, or the server said so (shutting down, out of
    /// connections, the slot held by another consumer, which a standby waits on). Not a
    /// configuration, privilege or protocol problem: the same answer would come again.
    pub fn is_retryable(&self) -> bool {
        match self {
            ConnectionError::Io(_) | ConnectionError::NoPrimary(_) => true,
            ConnectionError::Server { code, .. } => {
                code == SLOT_IN_USE
                    || ["08", "40", "53", "57", "58"]
                        .iter()
                        .any(|class| code.starts_with(class))
            }
            ConnectionError::Tls(_) | ConnectionError::Protocol(_) => false,
        }
    }

    fn protocol(what: impl Into<String>) -> Self {
        ConnectionError::Protocol(what.into())
    }
}

type Result<T> = std::result::Result<T, ConnectionError>;

/// object_in_use: PostgreSQL's answer to START_REPLICATION on a slot another session holds.
pub(crate) const SLOT_IN_USE: &str = "55006";

/// A server to dial: a host name or address, or a directory holding its Unix socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Where and as whom to connect.
#[derive(Clone)]
pub struct ConnectOptions {
    /// The URL's hosts, in its order (libpq's multi-host form).
    pub endpoints: Vec<Endpoint>,
    pub user: String,
    pub password: String,
    pub database: String,
    pub application_name: String,
    /// The `options` startup parameter (`-c name=value ...`).
    pub options: String,
    pub tls: outbox_store_postgres::tls::TlsUse,
    pub tls_config: Arc<rustls::ClientConfig>,
    /// How long connecting and authenticating may take.
    pub connect_timeout: Duration,
    /// libpq's `channel_binding`: SCRAM bound to the TLS session where the server offers
    /// it (`prefer`), required (`require`: no password is sent any other way), or not.
    pub channel_binding: tokio_postgres::config::ChannelBinding,
}

/// The hash RFC 5929 binds a SCRAM login to: the certificate's own, by its signature's
/// hash algorithm, MD5 and SHA-1 read as SHA-256. `None` for a signature without such a
/// hash (RSASSA-PSS names its own in parameters, Ed25519 has none) or a certificate that
/// does not parse.
fn end_point_hash(certificate: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest;
    use x509_cert::der::Decode;
    let parsed = x509_cert::Certificate::from_der(certificate).ok()?;
    let oid = parsed.signature_algorithm.oid.to_string();
    let hash = match oid.as_str() {
        // md5WithRSA, sha1WithRSA, sha256WithRSA, ecdsa-with-SHA1, ecdsa-with-SHA256
        "1.2.840.113549.1.1.4"
        | "1.2.840.113549.1.1.5"
        | "1.2.840.113549.1.1.11"
        | "1.2.840.10045.4.1"
        | "1.2.840.10045.4.3.2" => sha2::Sha256::digest(certificate).to_vec(),
        // sha384WithRSA, ecdsa-with-SHA384
        "1.2.840.113549.1.1.12" | "1.2.840.10045.4.3.3" => {
            sha2::Sha384::digest(certificate).to_vec()
        }
        // sha512WithRSA, ecdsa-with-SHA512
        "1.2.840.113549.1.1.13" | "1.2.840.10045.4.3.4" => {
            sha2::Sha512::digest(certificate).to_vec()
        }
        _ => return None,
    };
    Some(hash)
}

/// The socket, encrypted or not.
enum Socket {
    Plain(TcpStream),
    /// rustls reads the socket 4 KiB at a time; the buffer underneath takes what has
    /// arrived in one system call.
    Tls(Box<tokio_rustls::client::TlsStream<tokio::io::BufReader<TcpStream>>>),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Socket::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Tls(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Socket::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Tls(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Socket::Plain(s) => Pin::new(s).poll_flush(cx),
            Socket::Tls(s) => Pin::new(s).poll_flush(cx),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Socket::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Tls(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(unix)]
            Socket::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

impl Socket {
    /// SCRAM's `tls-server-end-point` channel binding: the hash of the server's certificate
    /// (RFC 5929); `None` without TLS, or for a certificate whose signature names no hash
    /// this knows.
    fn tls_server_end_point(&self) -> Option<Vec<u8>> {
        let Socket::Tls(tls) = self else {
            return None;
        };
        let certificate = tls.get_ref().1.peer_certificates()?.first()?;
        end_point_hash(certificate.as_ref())
    }

    /// The TCP socket underneath, if there is one.
    fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Socket::Plain(s) => Some(s),
            Socket::Tls(s) => Some(s.get_ref().0.get_ref()),
            #[cfg(unix)]
            Socket::Unix(_) => None,
        }
    }
}

/// How much must have arrived before the socket wakes a reader that asked to be woken late
/// ([`Connection::wake_late`]). A mark the receive buffer could not hold twice over would
/// make Linux grow the buffer and clamp the window to the mark for good; the initial buffer
/// (`net.ipv4.tcp_rmem`'s middle value, 128 KiB by default) holds this one with room to
/// spare, and at 10,000 events/s a millisecond's pace gathers less.
const LATE_WAKE_BYTES: i32 = 16 * 1024;

/// Sets the socket's receive low-water mark: the bytes that must be waiting before it is
/// reported readable (a read still returns whatever is there). Lowering it reports the
/// socket readable at once where that many are waiting: Linux (4.18 on) checks on the
/// change, which [`Connection::read_more`] relies on; elsewhere the mark is left alone.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_receive_low_water(socket: &TcpStream, bytes: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let value: libc::c_int = bytes;
    // SAFETY: the descriptor is the open socket that `socket` borrows for the call, and the
    // option's value is a c_int living through the call, passed with its size.
    let done = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if done == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn set_receive_low_water(_socket: &TcpStream, _bytes: i32) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// What a read asks of the socket at least: small reads cost a system call (and a TLS
/// record's processing) each.
const READ_SIZE: usize = 64 * 1024;

/// An authenticated connection in replication mode.
pub struct Connection {
    socket: Socket,
    /// What was read and not yet taken as messages.
    input: BytesMut,
    /// What is to be written: kept across cancelled writes, so a message never goes half.
    output: BytesMut,
    /// The socket's low-water mark is raised ([`Connection::wake_late`]) until the next
    /// read.
    waking_late: bool,
}

/// One message from the server: its type byte and its body.
struct Message {
    tag: u8,
    body: Bytes,
}

impl Connection {
    /// Connects to `endpoint`, negotiates TLS and authenticates, within the options'
    /// timeout.
    pub async fn connect(options: &ConnectOptions, endpoint: &Endpoint) -> Result<Connection> {
        match tokio::time::timeout(options.connect_timeout, Self::open(options, endpoint)).await {
            Ok(connection) => connection,
            Err(_) => Err(ConnectionError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no connection to {endpoint} within {:?}",
                    options.connect_timeout
                ),
            ))),
        }
    }

    async fn open(options: &ConnectOptions, endpoint: &Endpoint) -> Result<Connection> {
        let socket = Self::socket(options, endpoint).await?;
        let mut connection = Connection {
            socket,
            input: BytesMut::with_capacity(READ_SIZE),
            output: BytesMut::new(),
            waking_late: false,
        };
        let params = [
            ("user", options.user.as_str()),
            ("database", options.database.as_str()),
            ("replication", "database"),
            ("application_name", options.application_name.as_str()),
            ("options", options.options.as_str()),
            ("client_encoding", "UTF8"),
        ];
        frontend::startup_message(params, &mut connection.output)?;
        connection.flush().await?;
        connection.authenticate(options).await?;
        // Parameter statuses and the cancellation key, up to the first ReadyForQuery.
        loop {
            let message = connection.message().await?;
            match message.tag {
                b'Z' => return Ok(connection),
                b'E' => return Err(server_error(&message.body)),
                _ => {}
            }
        }
    }

    async fn socket(options: &ConnectOptions, endpoint: &Endpoint) -> Result<Socket> {
        use outbox_store_postgres::tls::TlsUse;
        let Endpoint { host, port } = endpoint;
        #[cfg(unix)]
        if host.starts_with('/') {
            let path = PathBuf::from(host).join(format!(".s.PGSQL.{port}"));
            return Ok(Socket::Unix(tokio::net::UnixStream::connect(path).await?));
        }
        let mut tcp = TcpStream::connect((host.as_str(), *port)).await?;
        tcp.set_nodelay(true)?;
        if options.tls == TlsUse::Never {
            return Ok(Socket::Plain(tcp));
        }
        let mut request = BytesMut::new();
        frontend::ssl_request(&mut request);
        tcp.write_all(&request).await?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer).await?;
        match (answer[0], options.tls) {
            (b'S', _) => {}
            (b'N', TlsUse::IfOffered) => return Ok(Socket::Plain(tcp)),
            (b'N', _) => {
                return Err(ConnectionError::Tls(
                    "the server does not accept TLS connections, and sslmode asks for TLS".into(),
                ))
            }
            (other, _) => {
                return Err(ConnectionError::protocol(format!(
                    "unexpected answer {other:#x} to the TLS request"
                )))
            }
        }
        let name = rustls::pki_types::ServerName::try_from(host.clone())
            .map_err(|e| ConnectionError::Tls(format!("host name {host:?}: {e}")))?;
        let connector = tokio_rustls::TlsConnector::from(options.tls_config.clone());
        let tls = connector
            .connect(name, tokio::io::BufReader::with_capacity(READ_SIZE, tcp))
            .await
            .map_err(|e| ConnectionError::Tls(e.to_string()))?;
        Ok(Socket::Tls(Box::new(tls)))
    }

    /// Answers the server's authentication request: none, a password, md5 or SCRAM-SHA-256
    /// (bound to the TLS session where both sides can, as libpq's `channel_binding` says).
    async fn authenticate(&mut self, options: &ConnectOptions) -> Result<()> {
        use tokio_postgres::config::ChannelBinding as Mode;
        let password = options.password.as_bytes();
        let mut scram: Option<ScramSha256> = None;
        let required = options.channel_binding == Mode::Require;
        let end_point = match options.channel_binding {
            Mode::Disable => None,
            _ => self.socket.tls_server_end_point(),
        };
        // With channel binding required, nothing but SCRAM bound to this TLS session proves
        // the server is the one the certificate names: the password is sent no other way.
        let unbound = |method: &str| {
            ConnectionError::protocol(format!(
                "channel_binding=require, and the server asked for {method}, which has no \
                 channel binding: the password is not sent (use scram-sha-256 over TLS for the \
                 relay's role, or drop channel_binding=require)"
            ))
        };
        let mut bound = false;
        loop {
            let message = self.message().await?;
            match message.tag {
                b'R' => {}
                b'E' => return Err(server_error(&message.body)),
                other => {
                    return Err(ConnectionError::protocol(format!(
                        "unexpected message {:?} while authenticating",
                        other as char
                    )))
                }
            }
            let mut body = message.body;
            if body.len() < 4 {
                return Err(ConnectionError::protocol("short authentication message"));
            }
            match body.get_i32() {
                0 if required && !bound => return Err(unbound("no authentication at all")),
                0 => return Ok(()),
                3 if required => return Err(unbound("a cleartext password")),
                5 if required => return Err(unbound("an md5 password")),
                3 => frontend::password_message(password, &mut self.output)?,
                5 => {
                    if body.len() < 4 {
                        return Err(ConnectionError::protocol("md5 request without salt"));
                    }
                    let salt = [body[0], body[1], body[2], body[3]];
                    let hash = postgres_protocol::authentication::md5_hash(
                        options.user.as_bytes(),
                        password,
                        salt,
                    );
                    frontend::password_message(hash.as_bytes(), &mut self.output)?;
                }
                10 => {
                    let offered: Vec<&[u8]> =
                        body.split(|b| *b == 0).filter(|m| !m.is_empty()).collect();
                    let plus = offered.contains(&SCRAM_SHA_256_PLUS.as_bytes());
                    let (mechanism, binding) = match end_point.clone() {
                        Some(hash) if plus => {
                            bound = true;
                            (
                                SCRAM_SHA_256_PLUS,
                                ChannelBinding::tls_server_end_point(hash),
                            )
                        }
                        _ if required => {
                            return Err(unbound(
                                "SCRAM without channel binding (no TLS, or a \
                                                server that offers no SCRAM-SHA-256-PLUS)",
                            ))
                        }
                        // Said to a server that offers no binding: a server that dropped the
                        // offer on the way (a man in the middle) then refuses the login.
                        Some(_) => (SCRAM_SHA_256, ChannelBinding::unrequested()),
                        None => (SCRAM_SHA_256, ChannelBinding::unsupported()),
                    };
                    if !offered.contains(&mechanism.as_bytes()) {
                        return Err(ConnectionError::protocol(
                            "the server offers no SASL mechanism this client knows (SCRAM-SHA-256)",
                        ));
                    }
                    let client = ScramSha256::new(password, binding);
                    frontend::sasl_initial_response(mechanism, client.message(), &mut self.output)?;
                    scram = Some(client);
                }
                11 => {
                    let client = scram
                        .as_mut()
                        .ok_or_else(|| ConnectionError::protocol("SASL continue out of turn"))?;
                    client.update(&body)?;
                    frontend::sasl_response(client.message(), &mut self.output)?;
                }
                12 => {
                    let mut client = scram
                        .take()
                        .ok_or_else(|| ConnectionError::protocol("SASL final out of turn"))?;
                    client.finish(&body).map_err(|e| {
                        ConnectionError::protocol(format!("the server's SCRAM proof: {e}"))
                    })?;
                    continue;
                }
                code => {
                    return Err(ConnectionError::protocol(format!(
                        "authentication method {code} is not supported (use password, md5 or \
                         scram-sha-256 for the relay's role in pg_hba.conf)"
                    )))
                }
            }
            self.flush().await?;
        }
    }

    /// Runs `sql` (SQL or a replication command) and returns the rows, as text.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
        frontend::query(sql, &mut self.output)?;
        self.flush().await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let message = self.message().await?;
            match message.tag {
                b'D' => rows.push(data_row(message.body)?),
                b'E' => error = Some(server_error(&message.body)),
                b'Z' => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    }
                }
                _ => {}
            }
        }
    }

    /// Starts streaming the slot's changes from `start` (the slot's confirmed position: the
    /// server never goes back before it) with pgoutput, outbox messages included.
    pub async fn start_replication(
        mut self,
        slot: &str,
        publication: &str,
        start: Lsn,
        status_interval: Duration,
    ) -> Result<ReplicationStream> {
        let command = format!(
            "START_REPLICATION SLOT {slot} LOGICAL {start} \
             (proto_version '1', publication_names '{publication}', messages 'true')"
        );
        frontend::query(&command, &mut self.output)?;
        self.flush().await?;
        loop {
            let message = self.message().await?;
            match message.tag {
                // CopyBothResponse: the stream begins.
                b'W' => break,
                b'E' => return Err(server_error(&message.body)),
                _ => {}
            }
        }
        Ok(ReplicationStream {
            connection: self,
            confirmed: start,
            reported: None,
            status_interval,
            next_status: Instant::now() + status_interval,
            ended: false,
        })
    }

    /// Writes what is queued. Cancel-safe: what a cancelled write did not take stays queued.
    async fn flush(&mut self) -> Result<()> {
        while !self.output.is_empty() {
            let n = self.socket.write(&self.output).await?;
            if n == 0 {
                return Err(std::io::Error::from(std::io::ErrorKind::WriteZero).into());
            }
            self.output.advance(n);
        }
        self.socket.flush().await?;
        Ok(())
    }

    /// The next whole message, if one was read already.
    fn buffered(&mut self) -> Result<Option<Message>> {
        if self.input.len() < 5 {
            return Ok(None);
        }
        let length =
            u32::from_be_bytes([self.input[1], self.input[2], self.input[3], self.input[4]]);
        let total = 1 + message_length(length)?;
        if self.input.len() < total {
            // A large message is read in as few reads as its size allows.
            self.input.reserve(total - self.input.len());
            return Ok(None);
        }
        let mut frame = self.input.split_to(total).freeze();
        let tag = frame[0];
        frame.advance(5);
        Ok(Some(Message { tag, body: frame }))
    }

    /// Until the next read, bytes arriving wake this thread only once `LATE_WAKE_BYTES`
    /// of them are waiting (on TCP; a Unix socket wakes as before). For a reader that will
    /// not read before a deadline anyway: under a steady stream each TCP segment arriving
    /// meanwhile woke the thread to no purpose, several times per burst pace. Once the mark
    /// is reached, [`Connection::filled_to_mark`] tells the reader to read.
    pub fn wake_late(&mut self) {
        if let (false, Some(tcp)) = (self.waking_late, self.socket.tcp()) {
            // Where it cannot be set, nothing changes but the wake-ups.
            self.waking_late = set_receive_low_water(tcp, LATE_WAKE_BYTES).is_ok();
        }
    }

    /// Returns once the socket holds a late wake's worth of bytes ([`Connection::wake_late`]):
    /// a burst's worth, for a reader pacing itself to end its pace early rather than be woken
    /// by every segment that follows (past the mark, each one wakes the thread). Also once
    /// the server has closed its end or the socket failed: the read that follows says so.
    /// Never returns while the socket wakes as usual (no mark raised, or not TCP).
    /// Cancel-safe.
    pub async fn filled_to_mark(&self) {
        let Some(tcp) = self.socket.tcp().filter(|_| self.waking_late) else {
            return std::future::pending().await;
        };
        loop {
            match tcp.ready(tokio::io::Interest::READABLE).await {
                // A closed end stays readable, and its readiness is never cleared: waiting on
                // would spin without yielding.
                Ok(ready) if ready.is_read_closed() => return,
                Ok(_) => {}
                Err(_) => return,
            }
            // A readiness the socket reported before the mark was raised ends no pace: it is
            // cleared (`WouldBlock`), and the next comes only once the mark is reached.
            let reached = tcp.try_io(tokio::io::Interest::READABLE, || {
                let waiting = rustix::io::ioctl_fionread(tcp)?;
                if waiting >= LATE_WAKE_BYTES as u64 {
                    Ok(())
                } else {
                    Err(std::io::ErrorKind::WouldBlock.into())
                }
            });
            match reached {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                _ => return,
            }
        }
    }

    /// Reads more from the socket. Cancel-safe. `false`: the server closed the connection.
    async fn read_more(&mut self) -> Result<bool> {
        if self.waking_late {
            if let Some(tcp) = self.socket.tcp() {
                // A mark left raised would keep a small message waiting: fail the session
                // rather.
                set_receive_low_water(tcp, 1)?;
            }
            self.waking_late = false;
        }
        if self.input.capacity() - self.input.len() < READ_SIZE / 4 {
            self.input.reserve(READ_SIZE);
        }
        Ok(self.socket.read_buf(&mut self.input).await? > 0)
    }

    /// The next message, reading as needed.
    async fn message(&mut self) -> Result<Message> {
        loop {
            if let Some(message) = self.buffered()? {
                return Ok(message);
            }
            if !self.read_more().await? {
                return Err(closed());
            }
        }
    }
}

fn closed() -> ConnectionError {
    ConnectionError::Io(std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "the server closed the connection",
    ))
}

/// An ErrorResponse's fields: its SQLSTATE and message (with the detail and hint).
fn server_error(body: &[u8]) -> ConnectionError {
    let (mut code, mut message, mut detail, mut hint) = (None, None, None, None);
    for field in body.split(|b| *b == 0).filter(|f| !f.is_empty()) {
        let value = String::from_utf8_lossy(&field[1..]).into_owned();
        match field[0] {
            b'C' => code = Some(value),
            b'M' => message = Some(value),
            b'D' => detail = Some(value),
            b'H' => hint = Some(value),
            _ => {}
        }
    }
    let mut message = message.unwrap_or_else(|| "error".into());
    for (label, text) in [("detail", detail), ("hint", hint)] {
        if let Some(text) = text {
            message = format!("{message} ({label}: {text})");
        }
    }
    ConnectionError::Server {
        code: code.unwrap_or_else(|| "XX000".into()),
        message,
    }
}

/// A DataRow's columns, as text (`None` for NULL).
fn data_row(mut body: Bytes) -> Result<Vec<Option<String>>> {
    let short = || ConnectionError::protocol("short DataRow");
    if body.len() < 2 {
        return Err(short());
    }
    let columns = body.get_u16();
    let mut row = Vec::with_capacity(columns as usize);
    for _ in 0..columns {
        if body.len() < 4 {
            return Err(short());
        }
        let length = body.get_i32();
        if length < 0 {
            row.push(None);
            continue;
        }
        let length = length as usize;
        if body.len() < length {
            return Err(short());
        }
        row.push(Some(
            String::from_utf8_lossy(&body.split_to(length)).into_owned(),
        ));
    }
    Ok(row)
}

/// What the replication stream carries.
#[derive(Debug)]
pub enum StreamMessage {
    /// One pgoutput message (XLogData's payload).
    Data(Bytes),
    /// The server's position, sent while it has nothing for this slot.
    Keepalive { wal_end: Lsn },
}

/// A started replication stream.
///
/// Contract:
/// - [`recv`](Self::recv) yields the server's messages in order, and is cancel-safe.
/// - The slot's confirmed position is reported as [`confirm`](Self::confirm) moves it,
///   at most every `status_interval`, from within `recv` and [`keep_alive`](Self::keep_alive);
///   a keepalive that asks for a reply is answered at once.
pub struct ReplicationStream {
    connection: Connection,
    confirmed: Lsn,
    /// The last position written in a status update.
    reported: Option<Lsn>,
    status_interval: Duration,
    next_status: Instant,
    /// The server ended the stream (CopyDone).
    ended: bool,
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const POSTGRES_EPOCH_MICROS: i64 = 946_684_800_000_000;

impl ReplicationStream {
    /// The next message; `None` once the server ended the stream.
    pub async fn recv(&mut self) -> Result<Option<StreamMessage>> {
        loop {
            if let Some(message) = self.connection.buffered()? {
                if let Some(message) = self.take(message).await? {
                    return Ok(Some(message));
                }
                if self.ended {
                    return Ok(None);
                }
                continue;
            }
            self.keep_alive().await?;
            let status_due = self.next_status;
            tokio::select! {
                biased;
                more = self.connection.read_more() => {
                    if !more? {
                        return Err(closed());
                    }
                }
                () = tokio::time::sleep_until(status_due) => {}
            }
        }
    }

    /// What a message means to the caller, answering what asks for an answer.
    async fn take(&mut self, message: Message) -> Result<Option<StreamMessage>> {
        let mut body = message.body;
        match message.tag {
            b'd' if body.first() == Some(&b'w') => {
                // 'w', the data's start and end positions and the server's clock.
                if body.len() < 25 {
                    return Err(ConnectionError::protocol("short XLogData"));
                }
                body.advance(25);
                Ok(Some(StreamMessage::Data(body)))
            }
            b'd' if body.first() == Some(&b'k') => {
                if body.len() < 18 {
                    return Err(ConnectionError::protocol("short keepalive"));
                }
                body.advance(1);
                let wal_end = Lsn(body.get_u64());
                let _clock = body.get_i64();
                if body.get_u8() == 1 {
                    // The server's wal_sender_timeout runs out without an answer.
                    self.send_status().await?;
                }
                Ok(Some(StreamMessage::Keepalive { wal_end }))
            }
            b'd' => Err(unknown_copy_data(&body)),
            b'E' => Err(server_error(&body)),
            b'c' | b'C' | b'Z' => {
                self.ended = true;
                Ok(None)
            }
            // Notices and parameter statuses.
            _ => Ok(None),
        }
    }

    /// Moves the position reported to the slot (never back).
    pub fn confirm(&mut self, lsn: Lsn) {
        self.confirmed = self.confirmed.max(lsn);
    }

    /// See [`Connection::wake_late`].
    pub fn wake_late(&mut self) {
        self.connection.wake_late();
    }

    /// See [`Connection::filled_to_mark`].
    pub async fn filled_to_mark(&self) {
        self.connection.filled_to_mark().await
    }

    /// The last position passed to [`confirm`](Self::confirm) (or the start).
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// The last position the server was sent.
    pub fn reported(&self) -> Option<Lsn> {
        self.reported
    }

    /// Sends a status update when one is due: the confirmed position moved, or the
    /// interval passed (an idle stream says it is alive). Call it while not reading the
    /// stream for a while, so the server's wal_sender_timeout does not end the session.
    pub async fn keep_alive(&mut self) -> Result<()> {
        // Half-written output goes first, whatever else is due.
        self.connection.flush().await?;
        if Instant::now() >= self.next_status {
            self.send_status().await?;
        }
        Ok(())
    }

    /// Reports the confirmed position as written, flushed and applied.
    async fn send_status(&mut self) -> Result<()> {
        let micros = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64)
            - POSTGRES_EPOCH_MICROS;
        let lsn = self.confirmed.0;
        let mut update = Vec::with_capacity(34);
        update.push(b'r');
        for position in [lsn, lsn, lsn] {
            update.extend_from_slice(&position.to_be_bytes());
        }
        update.extend_from_slice(&micros.to_be_bytes());
        update.push(0);
        frontend::CopyData::new(&update[..])?.write(&mut self.connection.output);
        self.connection.flush().await?;
        self.reported = Some(self.confirmed);
        self.next_status = Instant::now() + self.status_interval;
        Ok(())
    }

    /// Ends the stream: reports the confirmed position, ends the copy, and waits up to
    /// `wait` for the server to end its side before closing the connection.
    pub async fn finish(mut self, wait: Duration) -> Result<()> {
        let ending = async {
            self.send_status().await?;
            frontend::copy_done(&mut self.connection.output);
            self.connection.flush().await?;
            // The server sends what it had in flight, then CopyDone and the command's end.
            while !self.ended {
                let message = self.connection.message().await?;
                if matches!(message.tag, b'c' | b'C' | b'Z' | b'E') {
                    break;
                }
            }
            frontend::terminate(&mut self.connection.output);
            self.connection.flush().await
        };
        match tokio::time::timeout(wait, ending).await {
            Ok(result) => result,
            // The confirmation was written first: what the server had not read of the rest
            // only ends the session less politely.
            Err(_) => Ok(()),
        }
    }
}

/// The most a message may say it holds: a value PostgreSQL sends is at most 1 GiB (its
/// allocations' limit), and a message a little more with its framing. A length past it is
/// a broken stream, not a buffer to grow to 4 GiB for.
const MAX_MESSAGE_LENGTH: u32 = (1 << 30) + (1 << 20);

/// A message's length field, checked: the bytes after the tag.
fn message_length(length: u32) -> Result<usize> {
    if !(4..=MAX_MESSAGE_LENGTH).contains(&length) {
        return Err(ConnectionError::protocol(format!(
            "invalid message length {length}"
        )));
    }
    Ok(length as usize)
}

/// A CopyData of a kind this client does not know: it may carry WAL, and passing it by
/// would let the next keepalive confirm past what it held, so the session ends on it.
fn unknown_copy_data(body: &[u8]) -> ConnectionError {
    ConnectionError::protocol(format!(
        "a replication message of unknown kind {:?} ({} bytes): this PostgreSQL speaks a \
         newer protocol than this relay reads; upgrade the relay",
        body.first().map_or('?', |b| *b as char),
        body.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream whose server has sent `messages` (tag, body), read from its buffer.
    fn stream_that_received(
        messages: &[(u8, &[u8])],
    ) -> (ReplicationStream, std::os::unix::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut input = BytesMut::new();
        for (tag, body) in messages {
            input.extend_from_slice(&[*tag]);
            input.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
            input.extend_from_slice(body);
        }
        let connection = Connection {
            socket: Socket::Unix(tokio::net::UnixStream::from_std(ours).unwrap()),
            input,
            output: BytesMut::new(),
            waking_late: false,
        };
        let stream = ReplicationStream {
            connection,
            confirmed: Lsn(0),
            reported: None,
            status_interval: Duration::from_secs(10),
            next_status: Instant::now() + Duration::from_secs(10),
            ended: false,
        };
        (stream, theirs)
    }

    /// The socket's receive low-water mark.
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    fn receive_low_water(socket: &TcpStream) -> i32 {
        use std::os::fd::AsRawFd;
        let mut value: libc::c_int = 0;
        let mut size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: an open socket, and a c_int with its size to receive the option into.
        let done = unsafe {
            libc::getsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVLOWAT,
                std::ptr::from_mut(&mut value).cast(),
                &mut size,
            )
        };
        assert_eq!(done, 0, "{}", std::io::Error::last_os_error());
        value
    }

    /// A replication connection over plain TCP on loopback, and the server's end of it.
    #[cfg(target_os = "linux")]
    async fn plain_tcp_connection() -> (Connection, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap());
        let (client, server) = tokio::join!(client, listener.accept());
        let connection = Connection {
            socket: Socket::Plain(client.unwrap()),
            input: BytesMut::new(),
            output: BytesMut::new(),
            waking_late: false,
        };
        (connection, server.unwrap().0)
    }

    #[tokio::test]
    #[cfg(target_os = "linux")]
    async fn a_message_smaller_than_the_late_wake_mark_is_read_once_the_reader_reads() {
        let (mut connection, mut server) = plain_tcp_connection().await;
        let mark = |c: &Connection| receive_low_water(c.socket.tcp().unwrap());
        assert_eq!(mark(&connection), 1);
        connection.wake_late();
        assert_eq!(mark(&connection), LATE_WAKE_BYTES);
        connection.wake_late();
        // A whole message, far below the mark, sent while the reader was not reading.
        let mut message = vec![b'd'];
        message.extend_from_slice(&(4 + 3_i32).to_be_bytes());
        message.extend_from_slice(b"abc");
        tokio::io::AsyncWriteExt::write_all(&mut server, &message)
            .await
            .unwrap();
        // Arrived while the mark was up, so that only the read's lowering can report it.
        let waited = std::time::Instant::now();
        while rustix::io::ioctl_fionread(connection.socket.tcp().unwrap()).unwrap()
            < message.len() as u64
        {
            assert!(waited.elapsed() < Duration::from_secs(30), "never arrived");
            tokio::task::yield_now().await;
        }
        let read = tokio::time::timeout(Duration::from_secs(30), connection.message())
            .await
            .expect("a small message waits for no more bytes once the reader reads");
        assert_eq!(&read.unwrap().body[..], b"abc");
        assert_eq!(mark(&connection), 1, "lowered again by the read");
    }

    /// A paced reader (mark raised) is told when a late wake's worth of bytes waits, and not
    /// before: under a stream faster than the mark per pace, each segment past the mark woke
    /// the thread to no purpose until the pace ended (BENCHMARKS.md, "What a burst costs").
    #[tokio::test]
    #[cfg(target_os = "linux")]
    async fn a_paced_reader_is_told_once_the_late_wake_mark_is_reached_and_not_before() {
        use futures::FutureExt;
        let (mut connection, mut server) = plain_tcp_connection().await;
        let waiting = |c: &Connection| rustix::io::ioctl_fionread(c.socket.tcp().unwrap()).unwrap();
        let send_and_await = async |server: &mut TcpStream, c: &Connection, bytes: usize| {
            let before = waiting(c);
            tokio::io::AsyncWriteExt::write_all(server, &vec![b'x'; bytes])
                .await
                .unwrap();
            let sent = std::time::Instant::now();
            while waiting(c) < before + bytes as u64 {
                assert!(sent.elapsed() < Duration::from_secs(30), "never arrived");
                tokio::task::yield_now().await;
            }
        };
        let settle = async || {
            for _ in 0..10 {
                // The runtime's driver takes in whatever the socket reported meanwhile.
                tokio::task::yield_now().await;
            }
        };
        // Bytes that came before the mark was raised: the socket reported them readable.
        send_and_await(&mut server, &connection, 100).await;
        settle().await;
        assert!(
            connection.filled_to_mark().now_or_never().is_none(),
            "no mark raised: never (the reader reads as usual)"
        );
        connection.wake_late();
        assert!(
            connection.filled_to_mark().now_or_never().is_none(),
            "a readiness from before the mark is not a mark's worth"
        );
        let mark = LATE_WAKE_BYTES as usize;
        send_and_await(&mut server, &connection, mark - 101).await;
        settle().await;
        assert!(
            connection.filled_to_mark().now_or_never().is_none(),
            "a byte short of the mark"
        );
        send_and_await(&mut server, &connection, 1).await;
        tokio::time::timeout(Duration::from_secs(30), connection.filled_to_mark())
            .await
            .expect("told once the mark is reached");
    }

    /// The server closes its end while the reader paces itself, below the mark: the reader
    /// is told at once, so that its read reports the end. The closed end stays readable and
    /// its readiness cannot be cleared: the wait used to spin on it without ever yielding,
    /// holding the thread (and the pace's own deadline) for good.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_paced_reader_is_told_when_the_server_closes_below_the_mark() {
        let (told, tell) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let (mut connection, mut server) = plain_tcp_connection().await;
                connection.wake_late();
                tokio::io::AsyncWriteExt::write_all(&mut server, &[b'x'; 100])
                    .await
                    .unwrap();
                drop(server);
                connection.filled_to_mark().await;
            });
            let _ = told.send(());
        });
        // On a thread of its own: a wait that spins never yields to a timeout on its runtime.
        tell.recv_timeout(Duration::from_secs(30))
            .expect("told of the closed end (it spun instead)");
    }

    #[tokio::test]
    async fn a_replication_message_of_an_unknown_kind_ends_the_session_saying_so() {
        let mut keepalive = vec![b'k'];
        keepalive.extend_from_slice(&[0; 17]);
        let (mut stream, _server) = stream_that_received(&[(b'd', b"x\0\0"), (b'd', &keepalive)]);
        let e = stream.recv().await.expect_err("not passed by");
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("unknown kind 'x' (3 bytes)"), "{e}");
    }

    #[test]
    fn a_message_length_past_what_postgresql_sends_is_refused() {
        assert_eq!(message_length(4).unwrap(), 4);
        assert!(message_length(3).is_err());
        assert!(message_length(MAX_MESSAGE_LENGTH).is_ok());
        assert!(message_length(u32::MAX).is_err(), "4 GiB would be buffered");
    }

    #[test]
    fn an_error_response_keeps_its_sqlstate_detail_and_hint() {
        let body =
            b"SERROR\0C55006\0Mreplication slot \"s\" is active for PID 7\0Dby another\0Hwait\0\0";
        let error = server_error(body);
        assert_eq!(error.sqlstate(), Some("55006"));
        assert_eq!(
            error.to_string(),
            "replication slot \"s\" is active for PID 7 (detail: by another) (hint: wait) (SQLSTATE 55006)"
        );
    }

    #[test]
    fn a_data_row_reads_text_and_null_columns() {
        let mut body = BytesMut::new();
        body.extend_from_slice(&2u16.to_be_bytes());
        body.extend_from_slice(&1i32.to_be_bytes());
        body.extend_from_slice(b"t");
        body.extend_from_slice(&(-1i32).to_be_bytes());
        assert_eq!(
            data_row(body.freeze()).unwrap(),
            [Some("t".to_string()), None]
        );
        assert!(data_row(Bytes::from_static(&[0, 1, 0, 0, 0, 9, b'x'])).is_err());
    }
}
