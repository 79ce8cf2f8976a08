//! An engine in a child process of its own: the test binary runs its test
//! again, alone, with a variable set that makes the test be the engine. For
//! tests that read the engine's process alone (its memory, its descriptor
//! limit). The child prints `KT READY <tun>` once its engine runs, answers
//! each `stats` line on stdin with `KT STATS` and numbers, and stops its
//! engine when stdin closes.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kerntun::{Engine, StatsSnapshot};

/// The child's side: say READY with the TUN's name, answer `stats` lines
/// with the numbers `stats` picks, stop the engine when stdin closes.
pub fn serve(mut engine: Engine, stats: impl Fn(&StatsSnapshot) -> Vec<u64>) {
    println!("KT READY {}", engine.tun_name().expect("name"));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        if line == "stats" {
            let numbers: Vec<String> = stats(&engine.stats()).iter().map(u64::to_string).collect();
            println!("KT STATS {}", numbers.join(" "));
        }
    }
    engine.stop();
}

/// The child process and its pipes; stopped (or killed) on drop.
#[derive(Debug)]
pub struct EngineProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl EngineProcess {
    /// Run the test `test` of this binary again in a child (it inherits the
    /// calling thread's network namespace) with `env` set; `wrapper` is a
    /// command line that then runs it (`prlimit --nofile=... --`), or empty.
    pub fn start(test: &str, env: (&str, &str), wrapper: &[&str]) -> EngineProcess {
        let exe = std::env::current_exe().expect("test executable");
        let mut cmd = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let mut child = cmd
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(env.0, env.1)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("child test process");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        EngineProcess {
            child,
            stdin,
            stdout,
        }
    }

    /// The child's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What follows `KT ` on the next line that has it (the test harness
    /// prints lines of its own).
    pub fn line(&mut self) -> String {
        let mut l = String::new();
        loop {
            l.clear();
            let n = self.stdout.read_line(&mut l).expect("child stdout");
            assert!(n > 0, "the engine process ended early");
            // The harness prints "test <name> ... " before the first line.
            if let Some(i) = l.find("KT ") {
                return l[i + 3..].trim_end().to_owned();
            }
        }
    }

    /// The numbers of the child's answer to a `stats` line.
    pub fn stats(&mut self) -> Vec<u64> {
        let stdin = self.stdin.as_mut().expect("stdin");
        writeln!(stdin, "stats").expect("ask for stats");
        let l = self.line();
        l.strip_prefix("STATS ")
            .expect("a stats line")
            .split(' ')
            .map(|n| n.parse().expect("number"))
            .collect()
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        // EOF on stdin: the child stops its engine and exits.
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
