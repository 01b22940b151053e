//! Progress output: indicatif bars with live figures when stdout is a terminal, plain lines (at
//! most one every few seconds per bar) otherwise.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Progress {
    multi: Option<MultiProgress>,
}

impl Progress {
    pub fn new() -> Self {
        let multi = std::io::stdout()
            .is_terminal()
            .then(|| MultiProgress::with_draw_target(ProgressDrawTarget::stdout()));
        Progress { multi }
    }

    /// A line that stays (printed above the bars in terminal mode).
    pub fn line(&self, msg: impl AsRef<str>) {
        match &self.multi {
            Some(m) => {
                let _ = m.println(msg.as_ref());
            }
            None => println!("{}", msg.as_ref()),
        }
    }

    pub fn bar(&self, len: u64, prefix: &str) -> Bar {
        let pb = self.multi.as_ref().map(|m| {
            let pb = m.add(ProgressBar::new(len));
            pb.set_style(
                ProgressStyle::with_template(
                    "{prefix:>14} [{elapsed_precise}] {bar:30.cyan/blue} {pos:>7}/{len:7} {msg}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            pb.set_prefix(prefix.to_string());
            pb.enable_steady_tick(Duration::from_millis(200));
            pb
        });
        Bar {
            pb,
            prefix: prefix.to_string(),
            len,
            last_plain: Instant::now(),
        }
    }
}

impl Default for Progress {
    fn default() -> Self {
        Self::new()
    }
}

pub struct Bar {
    pb: Option<ProgressBar>,
    prefix: String,
    len: u64,
    last_plain: Instant,
}

impl Bar {
    pub fn set(&mut self, pos: u64, msg: impl Into<String>) {
        match &self.pb {
            Some(pb) => {
                pb.set_position(pos);
                pb.set_message(msg.into());
            }
            None => {
                if self.last_plain.elapsed() >= Duration::from_secs(3) {
                    self.last_plain = Instant::now();
                    println!("{}: {pos}/{} {}", self.prefix, self.len, msg.into());
                }
            }
        }
    }

    pub fn finish(self, msg: impl Into<String>) {
        let msg = msg.into();
        match self.pb {
            Some(pb) => pb.finish_with_message(msg),
            None => println!("{}: {msg}", self.prefix),
        }
    }
}
