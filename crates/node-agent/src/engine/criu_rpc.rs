//! A CRIU restore through CRIU's RPC service (`criu swrk <fd>`), run by the job shim.
//!
//! The command line restore runs the restore gate as an action script, which CRIU starts
//! (`sh -c`, then the script) at each of its seven stages: 2–3 ms each, 15–20 ms a restore.
//! Through RPC, CRIU asks the caller at each stage instead (a message on a socket pair), and
//! the gate is the answer at "post-restore": every process has its memory and none has run.
//!
//! The options are the same as the command line's: [`Plan::from_argv`] takes the engine's
//! restore command and gives CRIU its long options as a configuration file (CRIU reads one
//! named in the request as if it were command line options); the images directory and the log
//! level go in the request itself. A command line with anything a configuration file cannot
//! say (a short option other than the engine's own, a value with spaces) has no plan, and the
//! shim runs it as a command.
//!
//! The messages are the subset of CRIU's `rpc.proto` (protocol version 2) that a restore uses,
//! with CRIU's field numbers.
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use prost::Message;

/// `criu_req_type`.
const RESTORE: i32 = 2;
const NOTIFY: i32 = 6;
/// The stage before CRIU restores anything (its own programs and libraries loaded).
pub const PRE_RESTORE: &str = "pre-restore";
/// The stage at which the restored processes have their memory and none has run.
pub const POST_RESTORE: &str = "post-restore";

#[derive(Clone, PartialEq, Message)]
struct CriuOpts {
    #[prost(int32, required, tag = "1")]
    images_dir_fd: i32,
    #[prost(int32, optional, tag = "9")]
    log_level: Option<i32>,
    #[prost(bool, optional, tag = "12")]
    notify_scripts: Option<bool>,
    #[prost(string, optional, tag = "51")]
    config_file: Option<String>,
    #[prost(string, optional, tag = "68")]
    images_dir: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct CriuReq {
    #[prost(int32, required, tag = "1")]
    kind: i32,
    #[prost(message, optional, tag = "2")]
    opts: Option<CriuOpts>,
    #[prost(bool, optional, tag = "3")]
    notify_success: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
struct CriuRestoreResp {
    #[prost(int32, required, tag = "1")]
    pid: i32,
}

#[derive(Clone, PartialEq, Message)]
struct CriuNotify {
    #[prost(string, optional, tag = "1")]
    script: Option<String>,
    #[prost(int32, optional, tag = "2")]
    pid: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct CriuResp {
    #[prost(int32, required, tag = "1")]
    kind: i32,
    #[prost(bool, required, tag = "2")]
    success: bool,
    #[prost(message, optional, tag = "4")]
    restore: Option<CriuRestoreResp>,
    #[prost(message, optional, tag = "5")]
    notify: Option<CriuNotify>,
    #[prost(int32, optional, tag = "7")]
    cr_errno: Option<i32>,
    #[prost(string, optional, tag = "9")]
    cr_errmsg: Option<String>,
}

/// A restore command line, as CRIU's RPC service takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The CRIU binary.
    pub program: String,
    /// `-D`.
    pub images_dir: String,
    /// `-v<N>`.
    pub log_level: Option<i32>,
    /// The long options, one per line, as CRIU's configuration file takes them (`-o` becomes
    /// `log-file`).
    pub config: String,
}

impl Plan {
    /// The plan for `argv` (`criu restore ...` as the engine builds it), or None when a
    /// configuration file cannot carry it. `--pidfile` is dropped (the answer names the
    /// restored root), `-d` is implied (the service always detaches), and so is
    /// `--network-lock` (a restore takes the method from the images; CRIU 4.2 also fails on
    /// the option in a configuration file of its RPC service). With `gated`, the first
    /// `--action-script` is the gate's, which the caller answers for; others stay.
    pub fn from_argv(argv: &[String], gated: bool) -> Option<Plan> {
        let (program, rest) = argv.split_first()?;
        let (verb, rest) = rest.split_first()?;
        if verb != "restore" {
            return None;
        }
        let mut images_dir = None;
        let mut log_level = None;
        let mut gate_seen = !gated;
        let mut config = String::new();
        let mut i = 0;
        let value = |i: usize| rest.get(i + 1).filter(|v| plain(v));
        while i < rest.len() {
            let a = &rest[i];
            match a.as_str() {
                "-d" | "--restore-detached" => {}
                "-D" | "--images-dir" => {
                    images_dir = Some(value(i)?.clone());
                    i += 1;
                }
                "-o" | "--log-file" => {
                    config.push_str(&format!("log-file {}\n", value(i)?));
                    i += 1;
                }
                "--pidfile" | "--network-lock" => {
                    value(i)?;
                    i += 1;
                }
                "--action-script" if !gate_seen => {
                    value(i)?;
                    gate_seen = true;
                    i += 1;
                }
                v if v.len() > 2 && v.starts_with("-v") => {
                    log_level = Some(v[2..].parse().ok()?);
                }
                long if long.starts_with("--") && long.len() > 2 && plain(long) => {
                    match rest.get(i + 1) {
                        Some(v) if !v.starts_with('-') => {
                            if !plain(v) {
                                return None;
                            }
                            config.push_str(&format!("{} {v}\n", &long[2..]));
                            i += 1;
                        }
                        _ => config.push_str(&format!("{}\n", &long[2..])),
                    }
                }
                _ => return None,
            }
            i += 1;
        }
        if !gate_seen {
            return None;
        }
        Some(Plan {
            program: program.clone(),
            images_dir: images_dir?,
            log_level,
            config,
        })
    }
}

/// A word CRIU's configuration file reader takes as it is: no spaces, quotes, comment marks
/// or control characters.
fn plain(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_graphic() && !matches!(c, '"' | '\'' | '#' | '\\'))
}

/// The caller's end of the service's socket pair, after the service started on the other.
pub struct Session {
    sock: OwnedFd,
}

impl Session {
    /// The two ends of a socket pair: the caller's session, and the end to give CRIU (as
    /// `criu swrk <its number>`).
    pub fn pair() -> io::Result<(Session, OwnedFd)> {
        let (a, b) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::SeqPacket,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        Ok((Session { sock: a }, b))
    }

    /// Runs the restore of `plan` with its configuration file at `config_file`. `gate`, if
    /// any, decides at post-restore (Ok: let the processes run; its refusal is the error).
    /// `ended` tells whether CRIU has ended (and how): the restored processes hold copies of
    /// CRIU's end until they resume, so a CRIU that dies half way gives no end-of-file. Gives
    /// up after `limit`. Returns the restored root's PID.
    pub fn restore(
        &self,
        plan: &Plan,
        config_file: &str,
        mut stage: impl FnMut(&str) -> Result<(), String>,
        mut ended: impl FnMut() -> Option<String>,
        limit: Duration,
    ) -> Result<i32, String> {
        let req = CriuReq {
            kind: RESTORE,
            opts: Some(CriuOpts {
                images_dir_fd: -1,
                images_dir: Some(plan.images_dir.clone()),
                log_level: plan.log_level,
                notify_scripts: Some(true),
                config_file: Some(config_file.to_string()),
            }),
            notify_success: None,
        };
        self.send(&req)?;
        let deadline = Instant::now() + limit;
        let mut refused = None;
        // Bounded: CRIU answers each stage once, then the restore.
        for _ in 0..64 {
            let resp = self.recv(deadline, limit, &mut ended)?;
            match resp.kind {
                NOTIFY => {
                    let script = resp.notify.and_then(|n| n.script).unwrap_or_default();
                    let verdict = stage(&script);
                    self.send(&CriuReq {
                        kind: NOTIFY,
                        opts: None,
                        notify_success: Some(verdict.is_ok()),
                    })?;
                    // CRIU kills what it restored and answers the restore with a failure.
                    refused = verdict.err().or(refused);
                }
                RESTORE if resp.success && refused.is_none() => {
                    return resp
                        .restore
                        .map(|r| r.pid)
                        .ok_or_else(|| "criu answered the restore without a PID".to_string());
                }
                RESTORE => {
                    return Err(
                        refused.unwrap_or_else(|| match (resp.cr_errmsg, resp.cr_errno) {
                            (Some(m), _) if !m.is_empty() => format!("criu: {m}"),
                            (_, Some(e)) if e != 0 => {
                                format!("criu: {}", io::Error::from_raw_os_error(e))
                            }
                            _ => "criu reported a failed restore".to_string(),
                        }),
                    )
                }
                other => return Err(format!("criu answered with message type {other}")),
            }
        }
        Err("criu sent more stage notices than a restore has".into())
    }

    fn send(&self, req: &CriuReq) -> Result<(), String> {
        let buf = req.encode_to_vec();
        // SAFETY: sends a buffer of the length given on a socket this session owns.
        let n = unsafe {
            libc::send(
                self.sock.as_raw_fd(),
                buf.as_ptr().cast(),
                buf.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n != buf.len() as isize {
            return Err(format!(
                "cannot talk to criu: {}",
                io::Error::last_os_error()
            ));
        }
        Ok(())
    }

    /// The next answer, waiting until `deadline` while CRIU lives.
    fn recv(
        &self,
        deadline: Instant,
        limit: Duration,
        ended: &mut impl FnMut() -> Option<String>,
    ) -> Result<CriuResp, String> {
        let mut gone = None;
        loop {
            let mut pfd = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // After CRIU ended, only what it sent before is awaited.
            let wait = if gone.is_some() { 0 } else { 200 };
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, wait) };
            if n > 0 {
                break;
            }
            if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return Err(format!(
                    "cannot hear from criu: {}",
                    io::Error::last_os_error()
                ));
            }
            if let Some(how) = gone {
                return Err(format!(
                    "criu ended before it answered ({how}); see its log"
                ));
            }
            gone = ended();
            if gone.is_none() && Instant::now() > deadline {
                return Err(format!("criu did not answer within {} s", limit.as_secs()));
            }
        }
        let mut buf = vec![0u8; 64 * 1024];
        let n = loop {
            // SAFETY: receives into a buffer of the length given.
            let n =
                unsafe { libc::recv(self.sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break n;
            }
        };
        match n {
            n if n < 0 => Err(format!(
                "cannot hear from criu: {}",
                io::Error::last_os_error()
            )),
            0 => Err("criu ended before it answered (see its log)".into()),
            n => CriuResp::decode(&buf[..n as usize])
                .map_err(|e| format!("criu's answer cannot be read: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_engines_restore_command_becomes_a_request_and_a_configuration_file() {
        let p = Plan::from_argv(
            &args(
                "/opt/criu restore -d -D /s/images -o /s/logs/r.log -v4 --pidfile /s/run/p \
             --inherit-fd fd[3]:netns --root / --external mnt[] --cgroup-root /ckpt/1 \
             --action-script /bin/ckptd --ext-unix-sk --file-locks --tcp-established \
             --network-lock nftables",
            ),
            true,
        )
        .unwrap();
        assert_eq!(p.program, "/opt/criu");
        assert_eq!(p.images_dir, "/s/images");
        assert_eq!(p.log_level, Some(4));
        assert_eq!(
            p.config,
            "log-file /s/logs/r.log\ninherit-fd fd[3]:netns\nroot /\nexternal mnt[]\n\
             cgroup-root /ckpt/1\next-unix-sk\nfile-locks\ntcp-established\n"
        );
        // An operator's own script stays; without a gate every one is the operator's.
        let own = "criu restore -D /i --action-script /gate --action-script /site/hook";
        assert_eq!(
            Plan::from_argv(&args(own), true).unwrap().config,
            "action-script /site/hook\n"
        );
        assert_eq!(
            Plan::from_argv(&args(own), false).unwrap().config,
            "action-script /gate\naction-script /site/hook\n"
        );
        assert_eq!(
            Plan::from_argv(&args("criu restore -D /i"), true),
            None,
            "no gate script"
        );
    }

    #[test]
    fn what_a_configuration_file_cannot_say_has_no_plan() {
        for bad in [
            "criu dump -D /i",                    // not a restore
            "criu restore -o /l",                 // no images directory
            "criu restore -D /i -j",              // a short option of the user's
            "criu restore -D /i --root a\"b",     // a quote
            "criu restore -D /i --external #x",   // a comment mark
            "criu restore -D /i --ghost-limit\\", // a backslash
            "criu restore -D /i -v",              // verbosity by count
        ] {
            assert_eq!(Plan::from_argv(&args(bad), false), None, "{bad}");
        }
        let spaced = vec![
            "criu".to_string(),
            "restore".into(),
            "-D".into(),
            "/i".into(),
            "--root".into(),
            "/a b".into(),
        ];
        assert_eq!(
            Plan::from_argv(&spaced, false),
            None,
            "a value with a space"
        );
    }

    /// CRIU's side of the socket pair, for the tests of the conversation.
    fn put(fd: &OwnedFd, m: &impl Message) {
        let b = m.encode_to_vec();
        // SAFETY: a buffer of the length given.
        let n = unsafe { libc::send(fd.as_raw_fd(), b.as_ptr().cast(), b.len(), 0) };
        assert_eq!(n, b.len() as isize);
    }

    fn take(fd: &OwnedFd) -> CriuReq {
        let mut b = vec![0u8; 4096];
        // SAFETY: a buffer of the length given.
        let n = unsafe { libc::recv(fd.as_raw_fd(), b.as_mut_ptr().cast(), b.len(), 0) };
        assert!(n > 0, "the caller hung up");
        CriuReq::decode(&b[..n as usize]).unwrap()
    }

    fn notice(script: &str) -> CriuResp {
        CriuResp {
            kind: NOTIFY,
            success: true,
            notify: Some(CriuNotify {
                script: Some(script.into()),
                pid: None,
            }),
            ..CriuResp::default()
        }
    }

    /// A restore as CRIU's service runs one: the request, two stage notices, the answer
    /// (failed if a notice was refused). Returns the caller's answers to the notices.
    fn service(fd: OwnedFd) -> std::thread::JoinHandle<Vec<Option<bool>>> {
        std::thread::spawn(move || {
            let req = take(&fd);
            let opts = req.opts.expect("options");
            assert_eq!(req.kind, RESTORE);
            assert_eq!(opts.images_dir.as_deref(), Some("/i"));
            assert_eq!(opts.images_dir_fd, -1);
            assert_eq!(opts.notify_scripts, Some(true));
            assert_eq!(
                opts.config_file.as_deref(),
                Some("/run/1/criu-restore.conf")
            );
            let mut answers = Vec::new();
            for script in [PRE_RESTORE, POST_RESTORE] {
                put(&fd, &notice(script));
                answers.push(take(&fd).notify_success);
            }
            let ok = answers.iter().all(|a| *a == Some(true));
            put(
                &fd,
                &CriuResp {
                    kind: RESTORE,
                    success: ok,
                    restore: ok.then_some(CriuRestoreResp { pid: 4242 }),
                    cr_errmsg: (!ok).then(|| "script error".into()),
                    ..CriuResp::default()
                },
            );
            answers
        })
    }

    #[test]
    fn the_gate_answers_at_post_restore_and_its_refusal_is_the_error() {
        let plan = Plan::from_argv(&args("criu restore -D /i --action-script /g"), true).unwrap();
        let conf = "/run/1/criu-restore.conf";
        let never = || None;
        let t = Duration::from_secs(10);
        let (session, theirs) = Session::pair().unwrap();
        let criu = service(theirs);
        let mut stages = Vec::new();
        let pass = |s: &str| {
            stages.push(s.to_string());
            Ok(())
        };
        assert_eq!(session.restore(&plan, conf, pass, never, t), Ok(4242));
        assert_eq!(criu.join().unwrap(), [Some(true), Some(true)]);
        assert_eq!(stages, [PRE_RESTORE, POST_RESTORE], "each stage is asked");

        let (session, theirs) = Session::pair().unwrap();
        let criu = service(theirs);
        let refuse = |s: &str| match s {
            POST_RESTORE => Err("page data refused".to_string()),
            _ => Ok(()),
        };
        let err = session.restore(&plan, conf, refuse, never, t).unwrap_err();
        assert_eq!(err, "page data refused", "the gate's reason, not CRIU's");
        assert_eq!(criu.join().unwrap(), [Some(true), Some(false)]);
    }

    #[test]
    fn a_criu_that_ends_without_answering_is_noticed_though_its_socket_stays_open() {
        let plan = Plan::from_argv(&args("criu restore -D /i"), false).unwrap();
        let (session, theirs) = Session::pair().unwrap();
        // Its end stays open, as in the restored tasks that inherited it.
        let mut asked = 0;
        let ended = || {
            asked += 1;
            (asked >= 2).then(|| "killed by signal 9".to_string())
        };
        let err = session
            .restore(
                &plan,
                "/c",
                |_: &str| Ok(()),
                ended,
                Duration::from_secs(10),
            )
            .unwrap_err();
        assert!(
            err.contains("criu ended before it answered (killed by signal 9)"),
            "{err}"
        );
        drop(theirs);
    }

    #[test]
    fn messages_round_trip_with_criu_field_numbers() {
        // A restore answer as CRIU encodes it: type 2, success, restore { pid 4242 }.
        let wire = [0x08, 0x02, 0x10, 0x01, 0x22, 0x03, 0x08, 0x92, 0x21];
        let r = CriuResp::decode(&wire[..]).unwrap();
        assert_eq!((r.kind, r.success), (RESTORE, true));
        assert_eq!(r.restore.unwrap().pid, 4242);
        // A notification: type 6, success, notify { script "post-restore" }.
        let mut wire = vec![0x08, 0x06, 0x10, 0x01, 0x2a, 14, 0x0a, 12];
        wire.extend_from_slice(b"post-restore");
        let n = CriuResp::decode(&wire[..]).unwrap();
        assert_eq!(n.notify.unwrap().script.as_deref(), Some(POST_RESTORE));
        // The notify answer: type 6, notify_success true.
        let a = CriuReq {
            kind: NOTIFY,
            opts: None,
            notify_success: Some(true),
        };
        assert_eq!(a.encode_to_vec(), [0x08, 0x06, 0x18, 0x01]);
    }
}
