//! Helpers shared by the `kerntun` command's tests: a child process that is
//! killed and reaped on drop (also when the test panics), and the statistics
//! lines `kerntun run` prints. Bounded waits are the test kit's
//! (`kerntun_testkit::within`).

#![allow(dead_code)] // each test binary uses its own subset

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// The `kerntun` binary cargo built for these tests.
pub const KERNTUN: &str = env!("CARGO_BIN_EXE_kerntun");

/// A running `kerntun`; SIGKILLed and reaped on drop unless it already exited.
pub struct Running {
    child: Option<Child>,
    what: String,
}

impl Running {
    /// `ip netns exec NS kerntun ARGS` (`ip` execs the command, so the
    /// child's pid is kerntun's own and signals reach it directly).
    pub fn in_netns(ns: &str, args: &[&str]) -> Running {
        Running::in_netns_env(ns, args, &[])
    }

    /// [`Running::in_netns`] with extra environment variables.
    pub fn in_netns_env(ns: &str, args: &[&str], env: &[(&str, String)]) -> Running {
        let mut full = vec!["netns", "exec", ns, KERNTUN];
        full.extend_from_slice(args);
        let child = Command::new("ip")
            .args(&full)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ip netns exec kerntun");
        Running {
            child: Some(child),
            what: format!("kerntun {} (netns {ns})", args.join(" ")),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("child").id()
    }

    pub fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.pid() as i32), sig).expect("kill");
    }

    /// Whether it exited already (without reaping the output).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .expect("child")
            .try_wait()
            .expect("try_wait")
    }

    /// Wait up to `limit` for the exit; then its status, stdout and stderr.
    /// Panics (after a SIGKILL) when it does not exit in time.
    pub fn wait(mut self, limit: Duration) -> (ExitStatus, String, String) {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.exited() {
                break s;
            }
            if start.elapsed() > limit {
                let mut c = self.child.take().expect("child");
                let _ = c.kill();
                let _ = c.wait();
                let (out, err) = drain(&mut c);
                panic!(
                    "{} did not exit within {limit:?}\nstdout:\n{out}\nstderr:\n{err}",
                    self.what
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut c = self.child.take().expect("child");
        let (out, err) = drain(&mut c);
        (status, out, err)
    }

    /// Stop it with SIGKILL and return what it printed.
    pub fn kill_hard(mut self) -> (String, String) {
        let mut c = self.child.take().expect("child");
        let _ = c.kill();
        let _ = c.wait();
        drain(&mut c)
    }

    /// Panic with its output if it exited already (a failed start).
    pub fn assert_alive(&mut self, during: &str) {
        if let Some(s) = self.exited() {
            let mut c = self.child.take().expect("child");
            let (out, err) = drain(&mut c);
            panic!(
                "{} exited ({s}) {during}\nstdout:\n{out}\nstderr:\n{err}",
                self.what
            );
        }
    }
}

fn drain(c: &mut Child) -> (String, String) {
    let mut out = String::new();
    let mut err = String::new();
    if let Some(o) = c.stdout.as_mut() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(e) = c.stderr.as_mut() {
        let _ = e.read_to_string(&mut err);
    }
    (out, err)
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The statistics lines (JSON objects) among `kerntun run`'s stdout.
pub fn stats_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("uptime_ms").is_some())
        .collect()
}
