//! End-to-end tests of what an admin sees of the cluster: `ckptctl nodes` and `ckptctl status`
//! without a job, over agents on network-namespace test hosts, one of them taken down. Skips
//! with a printed reason where namespaces are unavailable.
use std::time::{Duration, Instant};

use ckpt_tests::netns::Cluster;
use ckpt_tests::prometheus::{http_get, Prometheus};
use ckpt_tests::{skip_unless_ready, Ckptd, Options};
use serde_json::Value;

use ckpt_tests::NOBODY;
const LIMIT: Duration = Duration::from_secs(30);

fn nodes_json(d: &Ckptd, uid: Option<u32>) -> Value {
    let args = ["nodes", "--json"];
    let out = match uid {
        Some(u) => d.ctl_as(u, &args),
        None => d.ctl(&args),
    };
    serde_json::from_str(out.ok().trim()).expect("nodes --json is JSON")
}

fn node<'a>(r: &'a Value, name: &str) -> &'a Value {
    r["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .find(|n| n["name"] == name)
        .unwrap_or_else(|| panic!("{name} listed: {r}"))
}

/// Waits (bounded) until `nodes --json` satisfies `cond`; returns that reply.
fn nodes_when(d: &Ckptd, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let begin = Instant::now();
    loop {
        let r = nodes_json(d, None);
        if cond(&r) {
            return r;
        }
        assert!(begin.elapsed() < LIMIT, "{what}: {r}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A job that sleeps on `node` (nothing to compute: these tests watch the cluster).
fn idle_job_on(d: &Ckptd, node: &str) -> u64 {
    d.ctl(&[
        "run", "--node", node, "--name", "idle", "--", "sleep", "300",
    ])
    .ok()
    .trim()
    .parse()
    .expect("job id")
}

/// A job started on a node right after ckptd restarted, before the node's agent has registered
/// again, waits for it (within `node_timeout` of ckptd's start) and starts: it is not refused as
/// an unknown node. Past `node_timeout`, a node that never registered is refused, named.
#[test]
fn a_run_right_after_ckptd_restarts_waits_for_the_nodes_agent_to_register_again() {
    skip_unless_ready!("nsenter", "sleep");
    if let Some(why) = Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let cluster = Cluster::create(1).expect("create test hosts");
    let mut d = Ckptd::start(Options {
        no_agent: true,
        extra_toml: "node_timeout = \"4s\"\n".into(),
        ..Options::default()
    });
    d.start_agent_in(&cluster, "n1");
    d.wait_agents(&["n1"]);
    // n1's agent cannot register with the new ckptd until it is let go.
    d.pause_agent_on("n1", true);
    d.stop_daemon();
    d.start_daemon();
    let begin = Instant::now();
    while d.ctl(&["list"]).code != 0 {
        assert!(begin.elapsed() < LIMIT, "ckptd did not come back");
        std::thread::sleep(Duration::from_millis(50));
    }
    let run = d.ctl_spawn(&["run", "--node", "n1", "--", "sleep", "300"]);
    std::thread::sleep(Duration::from_millis(1500));
    d.pause_agent_on("n1", false);
    let out = run.wait_with_output().expect("ckptctl run");
    assert!(
        out.status.success(),
        "refused: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let job: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("job id");
    assert_eq!(d.status(job)["state"], "running");
    // Long after the start, a node that never registered is refused at once, naming it.
    while begin.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = d.ctl(&["run", "--node", "n7", "--", "sleep", "300"]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(
        r.stderr.contains("n7") && r.stderr.contains("no agent is registered"),
        "{r:?}"
    );
    d.ctl(&["cancel", &job.to_string()]).ok();
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

#[test]
fn nodes_shows_every_agent_a_down_one_since_its_last_heartbeat_spares_and_jobs() {
    skip_unless_ready!("nsenter", "sleep");
    if let Some(why) = Cluster::unavailable() {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let cluster = Cluster::create(3).expect("create test hosts");
    // n3 is a spare, and so is n9, which has no agent at all.
    let mut d = Ckptd::start(Options {
        no_agent: true,
        extra_toml: "node_timeout = \"2s\"\n[spares]\nnodes = [\"n3\", \"n9\"]\n".into(),
        ..Options::default()
    });
    for n in ["n1", "n2", "n3"] {
        d.start_agent_in(&cluster, n);
    }
    d.wait_agents(&["n1", "n2", "n3"]);
    let job = idle_job_on(&d, "n1");

    // Every agent up, with what it reported: the first heartbeats bring the staging space.
    let r = nodes_when(&d, "every agent up with its staging space", |r| {
        ["n1", "n2", "n3"].iter().all(|n| {
            node(r, n)["state"] == "up" && node(r, n)["staging_total_bytes"].as_u64().is_some()
        })
    });
    assert_eq!(r["ckptd_version"], env!("CARGO_PKG_VERSION"), "{r}");
    assert_eq!(r["node_timeout_ms"], 2000, "{r}");
    let names: Vec<&str> = r["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    // node0: the standalone ckptd's own agent.
    assert_eq!(
        names,
        ["n1", "n2", "n3", "n9", "node0"],
        "sorted by name: {r}"
    );
    let local_rdma: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            let mut v: Vec<String> = d
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        })
        .unwrap_or_default();
    for n in ["n1", "n2", "n3"] {
        let i = node(&r, n);
        assert_eq!(i["version"], env!("CARGO_PKG_VERSION"), "{i}");
        let ip = &cluster.nodes.iter().find(|h| h.name == n).unwrap().mgmt_ip;
        assert!(
            i["address"]
                .as_str()
                .unwrap()
                .starts_with(&format!("{ip}:")),
            "{n}'s agent serves on its test host's management address {ip}: {i}"
        );
        let engines = i["engines"].as_array().unwrap();
        assert!(
            engines
                .iter()
                .any(|e| e["name"] == "criu" && !e["version"].as_str().unwrap().is_empty()),
            "{i}"
        );
        let (free, total) = (
            i["staging_free_bytes"].as_u64().unwrap(),
            i["staging_total_bytes"].as_u64().unwrap(),
        );
        assert!(free > 0 && free <= total, "{i}");
        assert!(i["heartbeat_age_ms"].as_u64().unwrap() < 2000, "{i}");
        assert_eq!(i["down_since_unix_ms"], Value::Null, "{i}");
        let rdma: Vec<String> = serde_json::from_value(i["rdma_devices"].clone()).unwrap();
        assert_eq!(rdma, local_rdma, "the kernel's RDMA devices: {i}");
    }
    assert_eq!(node(&r, "n1")["jobs"], serde_json::json!([job]), "{r}");
    assert_eq!(node(&r, "n2")["jobs"], serde_json::json!([]), "{r}");
    let n3 = node(&r, "n3");
    assert_eq!(
        (&n3["spare"], &n3["spare_free"]),
        (&Value::Bool(true), &Value::Bool(true)),
        "{n3}"
    );
    let n9 = node(&r, "n9");
    assert_eq!(n9["state"], "absent", "{n9}");
    assert_eq!(n9["spare"], true, "{n9}");
    assert_eq!(n9["heartbeat_age_ms"], Value::Null, "{n9}");

    // n2's agent dies: after node_timeout it is down, since its last heartbeat.
    let killed_at = now_ms();
    d.kill_agent_on("n2");
    let r = nodes_when(&d, "n2 down", |r| node(r, "n2")["state"] == "down");
    let n2 = node(&r, "n2");
    let since = n2["down_since_unix_ms"].as_u64().expect("down since");
    assert!(
        since <= killed_at + 1000 && since + 3000 >= killed_at,
        "down since its last heartbeat, about when its agent was killed ({killed_at}): {n2}"
    );
    assert!(n2["heartbeat_age_ms"].as_u64().unwrap() >= 2000, "{n2}");
    assert_eq!(
        n2["version"],
        env!("CARGO_PKG_VERSION"),
        "what it last said stays: {n2}"
    );
    for n in ["n1", "n3"] {
        assert_eq!(node(&r, n)["state"], "up", "{r}");
    }

    // In words: a line per node, the down one with its time and what to do, and a summary.
    let text = d.ctl(&["nodes"]).ok().to_string();
    println!("ckptctl nodes:\n{text}");
    let line = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("a line for {name}: {text}"))
            .to_string()
    };
    assert!(
        line("n1").contains(" up ") && line("n1").contains(&format!(" {job} ")),
        "{text}"
    );
    assert!(line("n2").contains("down since "), "{text}");
    assert!(line("n3").contains("spare (free)"), "{text}");
    assert!(line("n9").contains("absent"), "{text}");
    assert!(
        text.contains(
            "5 nodes: 3 up, 1 down (no heartbeat for 2s), 1 absent; spares: 1 of 2 up and free"
        ),
        "{text}"
    );
    assert!(
        text.contains("n2: no heartbeat for") && text.contains("ckpt-agent"),
        "{text}"
    );

    // Another user sees the nodes, and root's job only as a count.
    let r = nodes_json(&d, Some(NOBODY));
    let n1 = node(&r, "n1");
    assert_eq!(
        (&n1["jobs"], &n1["other_users_jobs"]),
        (&serde_json::json!([]), &serde_json::json!(1)),
        "{n1}"
    );

    // `status` without a job: the cluster in a few lines.
    let s: Value = serde_json::from_str(d.ctl(&["status", "--json"]).ok().trim()).unwrap();
    assert_eq!(
        s["nodes"],
        serde_json::json!({"total": 5, "up": 3, "down": 1, "absent": 1, "spares": 2, "spares_free": 1}),
        "{s}"
    );
    assert_eq!(s["jobs"]["live"]["running"], 1, "{s}");
    let text = d.ctl(&["status"]).ok().to_string();
    println!("ckptctl status:\n{text}");
    assert!(text.contains("n2 down since "), "{text}");
    assert!(
        text.contains("all users' jobs: 1 live (1 running)"),
        "{text}"
    );
    let text = d.ctl_as(NOBODY, &["status"]).ok().to_string();
    assert!(text.contains("your jobs: 0 live, 0 ended"), "{text}");

    // An agent that comes back is up again.
    d.start_agent_in(&cluster, "n2");
    nodes_when(&d, "n2 up again", |r| node(r, "n2")["state"] == "up");
    d.ctl(&["cancel", &job.to_string()]).ok();
}

/// The token Prometheus presents, in a root-only file.
fn token_file(dir: &std::path::Path) -> (std::path::PathBuf, String) {
    use std::os::unix::fs::PermissionsExt;
    let token = "ckpt-test-metrics-token-5f3a9c0e".to_string();
    let p = dir.join("metrics.token");
    std::fs::write(&p, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    (p, token)
}

/// `promtool check metrics` on a scrape's text.
fn promtool_passes(text: &str) {
    use std::io::Write;
    let mut c = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run promtool");
    c.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn prometheus_scrapes_ckptd_and_an_agent_during_checkpoints() {
    skip_unless_ready!("nsenter", "sleep");
    if let Some(why) = Cluster::unavailable().or_else(Prometheus::unavailable) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let cluster = Cluster::create(1).expect("create test host");
    let secrets = tempfile::tempdir().unwrap();
    let (tok, token) = token_file(secrets.path());
    let ckptd_addr = format!("127.0.0.1:{}", ckpt_tests::free_port());
    let mut d = Ckptd::start(Options {
        no_agent: true,
        extra_toml: format!(
            "[metrics]\nlisten = \"{ckptd_addr}\"\ntoken_file = \"{}\"\n",
            tok.display()
        ),
        ..Options::default()
    });
    let agent_addr = format!("{}:9464", cluster.node("n1").mgmt_ip);
    d.start_agent_in_with(
        &cluster,
        "n1",
        &format!(
            "[metrics]\nlisten = \"{agent_addr}\"\ntoken_file = \"{}\"\n",
            tok.display()
        ),
    );
    d.wait_agents(&["n1"]);
    let job = idle_job_on(&d, "n1");
    let prom = Prometheus::start(&[("ckptd", &ckptd_addr), ("agent", &agent_addr)], &tok);
    prom.wait_for("sum(up)", |v| v == 2.0);
    for _ in 0..3 {
        d.ctl(&["checkpoint", &job.to_string(), "--wait"]).ok();
    }

    // Through Prometheus' HTTP API: the epoch count, a phase latency quantile, the agent's
    // dumps, the agents up.
    prom.wait_for(
        r#"sum(ckpt_epochs_total{job="ckptd",outcome="committed"})"#,
        |v| v == 3.0,
    );
    let p90 = prom.wait_for(
        r#"histogram_quantile(0.9, sum by (le) (ckpt_phase_duration_seconds_bucket{phase="local-checkpoint"}))"#,
        |v| v.is_finite() && v > 0.0,
    );
    println!("local-checkpoint p90 through Prometheus: {p90} s");
    prom.wait_for(
        r#"sum(ckpt_agent_dump_duration_seconds_count{job="agent",engine="criu"})"#,
        |v| v == 3.0,
    );
    prom.wait_for(r#"ckpt_agents{state="up"}"#, |v| v == 2.0);
    prom.wait_for(r#"ckpt_jobs{state="running"}"#, |v| v == 1.0);
    prom.wait_for(r#"ckpt_agent_staging_free_bytes{job="agent"}"#, |v| v > 0.0);

    // Each endpoint's text passes promtool; ckptd's covers its embedded agent.
    let bearer = format!("Bearer {token}");
    let auth = [("Authorization", bearer.as_str())];
    let mut scraped = String::new();
    for (addr, has) in [
        (
            &ckptd_addr,
            ["ckpt_epochs_total", "ckpt_agent_staging_free_bytes"],
        ),
        (
            &agent_addr,
            [
                "ckpt_agent_dump_duration_seconds_bucket",
                "ckpt_agent_restores_total",
            ],
        ),
    ] {
        let (status, body) = http_get(addr, "/metrics", &auth).expect("scrape");
        scraped.push_str(&body);
        assert_eq!(status, 200, "{addr}: {body}");
        for name in has {
            assert!(body.contains(name), "{addr} has {name}: {body}");
        }
        promtool_passes(&body);
        // Without the token, with a wrong one, or elsewhere: nothing.
        let (status, body) = http_get(addr, "/metrics", &[]).unwrap();
        assert_eq!(status, 401, "{addr} without a token: {body}");
        assert!(!body.contains("ckpt_"), "{body}");
        let (status, _) = http_get(
            addr,
            "/metrics",
            &[("Authorization", "Bearer ckpt-test-metrics-token-5f3a9c0f")],
        )
        .unwrap();
        assert_eq!(status, 401, "{addr} with a wrong token");
        let (status, _) = http_get(addr, "/", &auth).unwrap();
        assert_eq!(status, 404, "{addr}/");
    }
    // The sample Grafana dashboard asks Prometheus only valid queries of metrics that exist.
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(
            ckpt_tests::workspace().join("packaging/grafana/ckpt-dashboard.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let mut exprs = 0;
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            let e = t["expr"]
                .as_str()
                .unwrap()
                .replace("$__rate_interval", "1m");
            prom.query(&e);
            for name in e
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("ckpt_"))
            {
                assert!(
                    scraped.contains(&format!("\n{name}")),
                    "dashboard query {e}: no metric {name}"
                );
            }
            exprs += 1;
        }
    }
    assert!(exprs >= 10, "{exprs} dashboard queries");

    // A local user cannot read the token.
    let mut cat = std::process::Command::new("cat");
    cat.arg(&tok);
    ckpt_tests::as_user(&mut cat, NOBODY);
    assert!(
        !cat.output().unwrap().status.success(),
        "the token file is root's"
    );
    d.ctl(&["cancel", &job.to_string()]).ok();
}
