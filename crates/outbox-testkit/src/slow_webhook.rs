//! A webhook receiver that takes its time: each request is answered after a pace (HTTP/1.1,
//! one request at a time per connection, as the webhook sink sends them), and the distinct
//! `webhook-id`s received are counted. A slow sink for WAL capture's memory budget, in its
//! test and in `outbox-bench`.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

pub struct SlowWebhook {
    pub addr: SocketAddr,
    ids: Arc<Mutex<HashSet<String>>>,
    waiting: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl SlowWebhook {
    /// Listens on a free loopback port; each request is answered `pace` after its body
    /// arrived.
    pub async fn start(pace: Duration) -> std::io::Result<SlowWebhook> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let ids: Arc<Mutex<HashSet<String>>> = Arc::default();
        let waiting: Arc<AtomicUsize> = Arc::default();
        let (recorded, counted) = (ids.clone(), waiting.clone());
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(answer_slowly(
                    socket,
                    pace,
                    recorded.clone(),
                    counted.clone(),
                ));
            }
        });
        Ok(SlowWebhook {
            addr,
            ids,
            waiting,
            task,
        })
    }

    /// Requests received and not answered yet.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// How many distinct events (by `webhook-id`) were answered.
    pub fn received(&self) -> usize {
        self.ids.lock().map(|ids| ids.len()).unwrap_or(0)
    }
}

impl Drop for SlowWebhook {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves one connection until it closes.
async fn answer_slowly(
    socket: tokio::net::TcpStream,
    pace: Duration,
    ids: Arc<Mutex<HashSet<String>>>,
    waiting: Arc<AtomicUsize>,
) {
    let mut socket = BufReader::new(socket);
    loop {
        let (mut length, mut id) = (0usize, None);
        loop {
            let mut line = String::new();
            if socket.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end().to_ascii_lowercase();
            if line.is_empty() {
                break;
            }
            if let Some(v) = line.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            } else if let Some(v) = line.strip_prefix("webhook-id:") {
                id = Some(v.trim().to_string());
            }
        }
        let mut body = vec![0; length];
        if socket.read_exact(&mut body).await.is_err() {
            return;
        }
        waiting.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(pace).await;
        waiting.fetch_sub(1, Ordering::SeqCst);
        if let (Ok(mut ids), Some(id)) = (ids.lock(), id) {
            ids.insert(id);
        }
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        if socket.get_mut().write_all(ok).await.is_err() {
            return;
        }
    }
}
