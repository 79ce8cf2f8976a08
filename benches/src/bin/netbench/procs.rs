//! The harness's child processes and namespaces: every child pid and
//! namespace is registered; `cleanup_all` runs from the Ctrl-C/SIGTERM
//! handler and from a guard dropped on any exit, so nothing outlives the
//! harness.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

static PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static NAMESPACES: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Set by the signal handler before it kills: no child is started after it.
static STOPPING: AtomicBool = AtomicBool::new(false);

/// Start a child and register its pid under the registry's lock, so the
/// signal handler (which sets [`STOPPING`] and then takes the lock) either
/// sees the pid or prevents the start: no child outlives the harness.
pub(super) fn spawn_registered(cmd: &mut Command) -> std::io::Result<Child> {
    let mut pids = PIDS
        .lock()
        .map_err(|_| std::io::Error::other("pid registry poisoned"))?;
    if STOPPING.load(Ordering::SeqCst) {
        return Err(std::io::Error::other("stopping"));
    }
    let child = cmd.spawn()?;
    pids.push(child.id());
    Ok(child)
}

pub(super) fn unregister_pid(pid: u32) {
    if let Ok(mut p) = PIDS.lock() {
        p.retain(|&x| x != pid);
    }
}

/// Register a namespace, deleted on any exit unless deleted before
/// ([`forget_ns`]).
pub(super) fn register_ns(name: &str) {
    if let Ok(mut n) = NAMESPACES.lock() {
        n.push(name.to_owned());
    }
}

/// A registered namespace that is gone already.
pub(super) fn forget_ns(name: &str) {
    if let Ok(mut n) = NAMESPACES.lock() {
        n.retain(|x| x != name);
    }
}

pub(super) fn cleanup_all() {
    STOPPING.store(true, Ordering::SeqCst);
    let pids = PIDS.lock().map(|mut p| std::mem::take(&mut *p));
    for pid in pids.unwrap_or_default() {
        if let Ok(p) = i32::try_from(pid) {
            let _ = kill(Pid::from_raw(p), Signal::SIGKILL);
        }
    }
    let names = NAMESPACES.lock().map(|mut n| std::mem::take(&mut *n));
    for ns in names.unwrap_or_default() {
        let _ = kerntun_testkit::sh("ip", &["netns", "del", &ns]);
    }
}

pub(super) struct CleanupGuard;

impl Drop for CleanupGuard {
    fn drop(&mut self) {
        cleanup_all();
    }
}

/// A child process in a namespace, killed and reaped on drop.
pub(super) struct Proc {
    child: Child,
    name: String,
    out: Option<PathBuf>,
    err: PathBuf,
}

impl Proc {
    /// `ip netns exec <ns> <program> <args>`; stdout to a file unless
    /// `piped` (then stdin and stdout are pipes), stderr always to a file.
    pub(super) fn spawn(
        tmp: &Path,
        name: &str,
        ns: &str,
        program: &Path,
        args: &[&str],
        piped: bool,
    ) -> Result<Proc, String> {
        let n = next_seq();
        let err = tmp.join(format!("{n:03}-{name}.err"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns])
            .arg(program)
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?);
        let out = if piped {
            cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
            None
        } else {
            let out = tmp.join(format!("{n:03}-{name}.out"));
            cmd.stdin(Stdio::null())
                .stdout(File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?);
            Some(out)
        };
        let child = spawn_registered(&mut cmd)
            .map_err(|e| format!("starting {}: {e}", program.display()))?;
        Ok(Proc {
            child,
            name: name.to_owned(),
            out,
            err,
        })
    }

    /// [`Proc::spawn`] as `uid` (and its group, no supplementary groups)
    /// when one is given: `setpriv` drops root's ids, then runs the program.
    pub(super) fn spawn_as(
        tmp: &Path,
        name: &str,
        ns: &str,
        uid: Option<u32>,
        program: &Path,
        args: &[&str],
    ) -> Result<Proc, String> {
        let Some(uid) = uid else {
            return Proc::spawn(tmp, name, ns, program, args, false);
        };
        let (u, g) = (format!("--reuid={uid}"), format!("--regid={uid}"));
        let program = program.to_string_lossy();
        let mut a = vec![u.as_str(), g.as_str(), "--clear-groups", "--", &program];
        a.extend_from_slice(args);
        Proc::spawn(tmp, name, ns, Path::new("setpriv"), &a, false)
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(super) fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub(super) fn wait_timeout(&mut self, limit: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(super) fn signal(&self, sig: Signal) {
        if let Ok(p) = i32::try_from(self.pid()) {
            let _ = kill(Pid::from_raw(p), sig);
        }
    }

    /// Send `sig`, wait up to `grace`, then SIGKILL. Returns the exit status,
    /// or an error naming the process when it had to be killed.
    pub(super) fn stop(&mut self, sig: Signal, grace: Duration) -> Result<ExitStatus, String> {
        if let Some(s) = self.exited() {
            return Ok(s);
        }
        self.signal(sig);
        if let Some(s) = self.wait_timeout(grace) {
            return Ok(s);
        }
        self.signal(Signal::SIGKILL);
        let _ = self.child.wait();
        Err(format!(
            "{} did not stop within {grace:?} of {sig}; killed",
            self.name
        ))
    }

    pub(super) fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.err).unwrap_or_default()
    }

    pub(super) fn stdout_text(&self) -> String {
        self.out
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default()
    }

    /// Lines of a piped stdout, delivered through a channel by a thread (so
    /// reads can time out).
    pub(super) fn stdout_lines(&mut self) -> Option<Receiver<String>> {
        let out = self.child.stdout.take()?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Some(rx)
    }

    pub(super) fn take_stdin(&mut self) -> Option<ChildStdin> {
        self.child.stdin.take()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.signal(Signal::SIGKILL);
            let _ = self.child.wait();
        }
        unregister_pid(self.child.id());
    }
}

pub(super) fn next_seq() -> u32 {
    use std::sync::atomic::AtomicU32;
    static SEQ: AtomicU32 = AtomicU32::new(0);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

/// Poll until `check` holds, up to `limit`.
pub(super) fn wait_for(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    check()
}

pub(super) fn listening(ns: &str, port: u16) -> bool {
    Command::new("ip")
        .args(["netns", "exec", ns, "ss", "-Hltn"])
        .arg(format!("sport = :{port}"))
        .output()
        .is_ok_and(|o| !o.stdout.is_empty())
}
