//! Progress for long commands: one line rewritten in place on a terminal, a plain line at
//! most every second otherwise (logs, CI).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub struct Progress {
    what: &'static str,
    total: u64,
    done: u64,
    terminal: bool,
    last: Option<Instant>,
}

impl Progress {
    pub fn new(what: &'static str, total: u64) -> Self {
        Progress {
            what,
            total,
            done: 0,
            terminal: std::io::stderr().is_terminal(),
            last: None,
        }
    }

    pub fn add(&mut self, n: u64) {
        self.done += n;
        let due = self
            .last
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if self.terminal {
            eprint!("\r{}", self.line());
            let _ = std::io::stderr().flush();
        } else if due {
            eprintln!("{}", self.line());
            self.last = Some(Instant::now());
        }
    }

    pub fn finish(self) {
        if self.terminal {
            eprintln!("\r{}", self.line());
        } else {
            eprintln!("{} (done)", self.line());
        }
    }

    fn line(&self) -> String {
        let percent = (self.done * 100)
            .checked_div(self.total)
            .map_or(100, |p| p.min(100));
        format!("{}: {}/{} ({percent}%)", self.what, self.done, self.total)
    }
}
