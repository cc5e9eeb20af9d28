//! A tiny stand-in for the Hugging Face hub on 127.0.0.1, enough for the `hf-hub` client:
//!
//! * `GET /{repo}/resolve/{revision}/{file}`: `X-Repo-Commit` on every answer. Small files are
//!   answered directly with `ETag`; `.safetensors` files (LFS on the real hub) get a `302` to
//!   `/cdn/{sha}` with `X-Linked-Etag` and `X-Linked-Size`. Unknown revisions and files get
//!   `404` with `X-Error-Code` (`RevisionNotFound`, `EntryNotFound`, `RepoNotFound`).
//! * `GET /cdn/{sha}`: the bytes.
//! * Both honour `Range: bytes=a-b` / `bytes=a-` (`206` + `Content-Range`; `416` past the end).
//!
//! One connection at a time, `Connection: close`. The server binds 127.0.0.1 on a random port
//! and stops by itself after [`LIFETIME`] or [`MAX_CONNECTIONS`], or when stopped/dropped.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The server gives up after this long even if nobody stops it.
pub const LIFETIME: Duration = Duration::from_secs(60);
/// ... or after this many connections.
pub const MAX_CONNECTIONS: usize = 200;

/// One request the server received.
#[derive(Debug, Clone)]
pub struct Logged {
    /// The request path (no query).
    pub path: String,
    /// The `Range` header.
    pub range: Option<String>,
    /// The `Authorization` header.
    pub auth: Option<String>,
    /// The repository file the request was about, if any.
    pub file: Option<String>,
}

/// A fault to inject once.
#[derive(Debug, Clone)]
pub struct Fault {
    file: String,
    after: usize,
}

impl Fault {
    /// The first body request (`Range: bytes=N-`) for `file` sends its headers, `after` bytes,
    /// and then closes the connection.
    pub fn drop_body(file: &str, after: usize) -> Self {
        Self {
            file: file.to_string(),
            after,
        }
    }
}

/// What the server serves: one repository at one commit.
#[derive(Debug, Clone)]
pub struct Site {
    repo: String,
    commit: String,
    files: BTreeMap<String, Vec<u8>>,
    fault: Option<Fault>,
}

impl Site {
    /// `files` of `repo` at `commit`; the revisions `main` and `commit` itself resolve to it.
    pub fn new(repo: &str, commit: &str, files: BTreeMap<String, Vec<u8>>) -> Self {
        Self {
            repo: repo.to_string(),
            commit: commit.to_string(),
            files,
            fault: None,
        }
    }

    /// Adds a fault.
    pub fn with_fault(mut self, fault: Fault) -> Self {
        self.fault = Some(fault);
        self
    }
}

/// The running server.
pub struct HubServer {
    base: String,
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Logged>>>,
    thread: Option<JoinHandle<()>>,
}

impl HubServer {
    /// Binds 127.0.0.1:0 and serves `site` on a thread.
    pub fn start(site: Site) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let base = format!("http://{}", listener.local_addr()?);
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut state = State {
            site,
            base: base.clone(),
            log: log.clone(),
        };
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            let mut served = 0;
            while !flag.load(Ordering::SeqCst) && start.elapsed() < LIFETIME && served < MAX_CONNECTIONS {
                match listener.accept() {
                    Ok((stream, _)) => {
                        served += 1;
                        // A broken connection only affects that request.
                        let _ = state.handle(stream);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2))
                    }
                    Err(_) => break,
                }
            }
        });
        Ok(Self {
            base,
            stop,
            log,
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:{port}`.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// Stops the server (the port is closed when this returns) and returns its request log.
    pub fn stop(mut self) -> Vec<Logged> {
        self.shutdown();
        let log = self.log.lock().map(|l| l.clone()).unwrap_or_default();
        log
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HubServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct State {
    site: Site,
    base: String,
    log: Arc<Mutex<Vec<Logged>>>,
}

/// A reply about to be written.
struct Reply {
    status: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    /// Close the connection after this many body bytes (the injected fault).
    cut: Option<usize>,
}

impl Reply {
    fn new(status: &'static str) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            cut: None,
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    fn error(status: &'static str, code: &str, message: &str) -> Self {
        let body = format!("{{\"error\":\"{message}\"}}").into_bytes();
        let mut r = Self::new(status)
            .header("X-Error-Code", code)
            .header("X-Error-Message", message)
            .header("Content-Type", "application/json");
        r.body = body;
        r
    }
}

/// A stable 40- or 64-hex-digit id of some bytes (FNV-1a lanes; not cryptographic).
fn hex_id(bytes: &[u8], digits: usize) -> String {
    let mut out = String::new();
    let mut lane = 0u64;
    while out.len() < digits {
        let mut h = 0xcbf2_9ce4_8422_2325u64 ^ lane;
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        out.push_str(&format!("{h:016x}"));
        lane += 1;
    }
    out.truncate(digits);
    out
}

fn is_lfs(file: &str) -> bool {
    file.ends_with(".safetensors")
}

impl State {
    fn handle(&mut self, stream: TcpStream) -> std::io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.set_write_timeout(Some(Duration::from_secs(5)))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let path = line
            .split_whitespace()
            .nth(1)
            .unwrap_or("/")
            .split('?')
            .next()
            .unwrap_or("/")
            .to_string();
        let (mut range, mut auth) = (None, None);
        for _ in 0..100 {
            let mut header = String::new();
            if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                match name.trim().to_ascii_lowercase().as_str() {
                    "range" => range = Some(value.trim().to_string()),
                    "authorization" => auth = Some(value.trim().to_string()),
                    _ => {}
                }
            }
        }
        let (reply, file) = self.route(&path, range.as_deref());
        if let Ok(mut log) = self.log.lock() {
            log.push(Logged {
                path,
                range,
                auth,
                file,
            });
        }
        write_reply(stream, reply)
    }

    fn route(&mut self, path: &str, range: Option<&str>) -> (Reply, Option<String>) {
        if let Some(id) = path.strip_prefix("/cdn/") {
            let found = self.site.files.iter().find(|(_, b)| hex_id(b, 64) == id);
            return match found {
                Some((name, bytes)) => {
                    let name = name.clone();
                    let reply = self.ranged(&name, bytes.clone(), range);
                    (reply, Some(name))
                }
                None => (Reply::error("404 Not Found", "EntryNotFound", "no such blob"), None),
            };
        }
        let prefix = format!("/{}/resolve/", self.site.repo);
        let Some(rest) = path.strip_prefix(&prefix) else {
            return (
                Reply::error("404 Not Found", "RepoNotFound", "Repository not found"),
                None,
            );
        };
        let Some((revision, file)) = rest.split_once('/') else {
            return (Reply::error("404 Not Found", "EntryNotFound", "Entry not found"), None);
        };
        if revision != "main" && revision != self.site.commit {
            let reply = Reply::error("404 Not Found", "RevisionNotFound", "Invalid rev id")
                .header("X-Repo-Commit", self.site.commit.clone());
            return (reply, Some(file.to_string()));
        }
        let commit = self.site.commit.clone();
        let Some(bytes) = self.site.files.get(file).cloned() else {
            let reply =
                Reply::error("404 Not Found", "EntryNotFound", "Entry not found").header("X-Repo-Commit", commit);
            return (reply, Some(file.to_string()));
        };
        let reply = if is_lfs(file) {
            let sha = hex_id(&bytes, 64);
            Reply::new("302 Found")
                .header("Location", format!("{}/cdn/{sha}", self.base))
                .header("X-Repo-Commit", commit)
                .header("X-Linked-Etag", format!("\"{sha}\""))
                .header("X-Linked-Size", bytes.len().to_string())
                .header("ETag", format!("\"{}\"", hex_id(file.as_bytes(), 40)))
        } else {
            self.ranged(file, bytes.clone(), range)
                .header("X-Repo-Commit", commit)
                .header("ETag", format!("\"{}\"", hex_id(&bytes, 40)))
        };
        (reply, Some(file.to_string()))
    }

    /// The bytes of `file`, honouring `range`, with the fault applied the first time it matches.
    fn ranged(&mut self, file: &str, bytes: Vec<u8>, range: Option<&str>) -> Reply {
        let total = bytes.len();
        let parsed = range
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.split_once('-'))
            .map(|(a, b)| {
                let start = a.parse::<usize>().ok();
                let end = if b.is_empty() {
                    Some(total.saturating_sub(1))
                } else {
                    b.parse::<usize>().ok()
                };
                (start, end, b.is_empty())
            });
        let mut reply = match parsed {
            None => {
                let mut r = Reply::new("200 OK");
                r.body = bytes;
                r
            }
            Some((Some(start), Some(end), open)) if start < total => {
                let end = end.min(total - 1);
                let mut r =
                    Reply::new("206 Partial Content").header("Content-Range", format!("bytes {start}-{end}/{total}"));
                r.body = bytes[start..=end].to_vec();
                if open && self.site.fault.as_ref().is_some_and(|f| f.file == file) {
                    r.cut = self.site.fault.take().map(|f| f.after);
                }
                r
            }
            Some(_) => Reply::new("416 Range Not Satisfiable").header("Content-Range", format!("bytes */{total}")),
        };
        reply.headers.push(("Accept-Ranges", "bytes".to_string()));
        reply
    }
}

fn write_reply(mut stream: TcpStream, reply: Reply) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {}\r\nConnection: close\r\nContent-Length: {}\r\n",
        reply.status,
        reply.body.len()
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    let body = match reply.cut {
        Some(n) => &reply.body[..n.min(reply.body.len())],
        None => &reply.body[..],
    };
    stream.write_all(body)?;
    stream.flush()?;
    stream.shutdown(std::net::Shutdown::Both)
}
