//! The cluster CA: created once on the head node, it issues one credential per node.
//!
//! Layout of a credential directory (default `/etc/ckpt/tls`, 0755 so that jobs can read the
//! CA certificate and verify the daemons they call):
//!
//! | file | on | mode | what |
//! |---|---|---|---|
//! | `ca.pem` | every machine | 0644 | the CA certificate (public) |
//! | `ca.key` | head node | 0600 | the CA key: whoever holds it can mint node credentials |
//! | `ckptd.pem`, `ckptd.key` | head node | 0644, 0600 | the coordinator's credential |
//! | `node.pem`, `node.key` | each node | 0644, 0600 | that node's credential |
//!
//! `ckptd ca issue NODE` prints a bundle (CA certificate, node certificate and key, PEM) that
//! `ckpt-agent enroll` installs on the node: `ckptd ca issue n1 | ssh n1 ckpt-agent enroll -`.
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use crate::{cert, valid_node_name, AuthError, Identity};

/// The CA certificate.
pub const CA_CERT: &str = "ca.pem";
/// The CA key.
pub const CA_KEY: &str = "ca.key";
/// The coordinator's certificate.
pub const COORDINATOR_CERT: &str = "ckptd.pem";
/// The coordinator's key.
pub const COORDINATOR_KEY: &str = "ckptd.key";
/// A node's certificate.
pub const NODE_CERT: &str = "node.pem";
/// A node's key.
pub const NODE_KEY: &str = "node.key";
/// Default credential directory.
pub const DEFAULT_DIR: &str = "/etc/ckpt/tls";

/// The one DNS name every certificate carries. TLS needs a server name to check; the identity
/// that matters is in the common name and is checked after the chain (see [`crate::tls`]).
pub const CLUSTER_NAME: &str = "ckpt-cluster";
/// Common name of the CA.
const CA_CN: &str = "ckpt cluster CA";
/// A CA lives as long as the cluster; replacing it means re-enrolling every node.
const CA_YEARS: i32 = 30;
/// Node and coordinator credentials; renewing one is `ckptd ca issue` again.
const LEAF_YEARS: i32 = 10;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> AuthError + '_ {
    move |source| AuthError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn gen_err(e: rcgen::Error) -> AuthError {
    AuthError::Generate(e.to_string())
}

/// The current year (UTC), for validity periods.
fn this_year() -> i32 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    1970 + (secs / 31_556_952) as i32
}

fn validity(params: &mut CertificateParams, years: i32) {
    let y = this_year();
    // From the start of last year: a node whose clock lags by months still accepts it.
    params.not_before = rcgen::date_time_ymd(y - 1, 1, 1);
    params.not_after = rcgen::date_time_ymd(y + years, 1, 1);
}

/// Writes `text` to `dir/name` with `mode`, atomically.
fn write_private(dir: &Path, name: &str, text: &str, mode: u32) -> Result<PathBuf, AuthError> {
    let path = dir.join(name);
    ckpt_store::atomic::write_file_mode(&path, text.as_bytes(), mode).map_err(|e| {
        AuthError::Io {
            path: path.clone(),
            source: std::io::Error::other(e.to_string()),
        }
    })?;
    Ok(path)
}

/// Creates the credential directory if needed: root's, readable by all (the CA certificate is
/// public; keys are 0600 inside).
fn make_dir(dir: &Path) -> Result<(), AuthError> {
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(io_err(dir))
}

fn leaf_params(id: &Identity) -> Result<CertificateParams, AuthError> {
    let mut p = CertificateParams::new(vec![CLUSTER_NAME.to_string()]).map_err(gen_err)?;
    p.distinguished_name
        .push(DnType::CommonName, id.common_name());
    p.distinguished_name
        .push(DnType::OrganizationName, "ckpt cluster");
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Every daemon is both: agents serve ckptd and call it, ckptd serves agents and calls them.
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.use_authority_key_identifier_extension = true;
    validity(&mut p, LEAF_YEARS);
    Ok(p)
}

/// A new credential for `id` signed by the CA in `dir`: (certificate PEM, key PEM).
fn sign_leaf(dir: &Path, id: &Identity) -> Result<(String, String), AuthError> {
    let ca_cert_path = dir.join(CA_CERT);
    let ca_key_path = dir.join(CA_KEY);
    let ca_pem = std::fs::read_to_string(&ca_cert_path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            AuthError::Bad {
                path: ca_cert_path.clone(),
                problem: "no cluster CA here: create it with `ckptd ca init` on the head node"
                    .into(),
            }
        } else {
            AuthError::Io {
                path: ca_cert_path.clone(),
                source,
            }
        }
    })?;
    let key_pem = std::fs::read_to_string(&ca_key_path).map_err(io_err(&ca_key_path))?;
    let ca_key = KeyPair::from_pem(&key_pem).map_err(|e| AuthError::Bad {
        path: ca_key_path.clone(),
        problem: format!("not a private key: {e}"),
    })?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key).map_err(|e| AuthError::Bad {
        path: ca_cert_path.clone(),
        problem: format!("not a CA certificate: {e}"),
    })?;
    let key = KeyPair::generate().map_err(gen_err)?;
    let cert = leaf_params(id)?.signed_by(&key, &issuer).map_err(gen_err)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Creates the cluster CA and the coordinator's credential in `dir` (`ckptd ca init`). Refuses
/// to replace an existing CA.
pub fn init(dir: &Path) -> Result<(), AuthError> {
    if dir.join(CA_KEY).exists() || dir.join(CA_CERT).exists() {
        return Err(AuthError::CaExists {
            dir: dir.to_path_buf(),
        });
    }
    make_dir(dir)?;
    let key = KeyPair::generate().map_err(gen_err)?;
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
    p.distinguished_name.push(DnType::CommonName, CA_CN);
    p.distinguished_name
        .push(DnType::OrganizationName, "ckpt cluster");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut p, CA_YEARS);
    let cert = p.self_signed(&key).map_err(gen_err)?;
    // The key first: a CA certificate without its key would block a second `init`.
    write_private(dir, CA_KEY, &key.serialize_pem(), 0o600)?;
    write_private(dir, CA_CERT, &cert.pem(), 0o644)?;
    let (cert, key) = sign_leaf(dir, &Identity::Coordinator)?;
    write_private(dir, COORDINATOR_KEY, &key, 0o600)?;
    write_private(dir, COORDINATOR_CERT, &cert, 0o644)?;
    Ok(())
}

/// A new credential for `node`, signed by the CA in `dir`, as one PEM bundle (CA certificate,
/// node certificate, node key) for [`install`] on the node (`ckptd ca issue NODE`).
pub fn issue(dir: &Path, node: &str) -> Result<String, AuthError> {
    if !valid_node_name(node) {
        return Err(AuthError::BadNodeName {
            name: node.to_string(),
        });
    }
    let ca = std::fs::read_to_string(dir.join(CA_CERT)).map_err(io_err(&dir.join(CA_CERT)))?;
    let (cert, key) = sign_leaf(dir, &Identity::Node(node.to_string()))?;
    Ok(format!("{ca}{cert}{key}"))
}

/// A node credential as [`issue`] prints it, taken apart.
#[derive(Debug, Clone)]
pub struct Bundle {
    /// The CA certificate (PEM).
    pub ca: String,
    /// The node's certificate (PEM).
    pub cert: String,
    /// The node's private key (PEM).
    pub key: String,
    /// The node it names.
    pub identity: Identity,
}

impl Bundle {
    /// Takes a bundle apart: one CA certificate, one node certificate and its key.
    pub fn parse(text: &str) -> Result<Bundle, AuthError> {
        let bad = |problem: String| AuthError::Bad {
            path: PathBuf::from("<bundle>"),
            problem,
        };
        let mut certs = Vec::new();
        let mut key = None;
        for block in pem_blocks(text) {
            if block.starts_with("-----BEGIN CERTIFICATE-----") {
                certs.push(block);
            } else if block.contains("PRIVATE KEY-----") {
                key = Some(block);
            }
        }
        let key = key.ok_or_else(|| {
            bad("no private key in it: pass the whole output of `ckptd ca issue NODE`".into())
        })?;
        let mut ca = None;
        let mut leaf = None;
        for c in certs {
            let der = cert::pem_to_der(&c).map_err(bad)?;
            match cert::common_name(&der).as_deref() {
                Some(CA_CN) => ca = Some(c),
                Some(cn) => {
                    let id = Identity::from_common_name(cn)
                        .ok_or_else(|| bad(format!("a certificate for {cn:?}, not a ckpt node")))?;
                    leaf = Some((c, id));
                }
                None => return Err(bad("a certificate without a common name".into())),
            }
        }
        let ca = ca.ok_or_else(|| bad("no CA certificate in it".into()))?;
        let (cert, identity) = leaf.ok_or_else(|| bad("no node certificate in it".into()))?;
        if !matches!(identity, Identity::Node(_)) {
            return Err(bad(
                "it holds the coordinator's credential, not a node's: issue one with `ckptd ca issue NODE`"
                    .into(),
            ));
        }
        Ok(Bundle {
            ca,
            cert,
            key,
            identity,
        })
    }
}

/// Installs a bundle from [`issue`] into `dir` (`ckpt-agent enroll`): `ca.pem`, `node.pem` and
/// `node.key` (0600). With `node`, refuses a bundle issued for another node. Returns the
/// identity installed.
pub fn install(bundle: &str, dir: &Path, node: Option<&str>) -> Result<Identity, AuthError> {
    let b = Bundle::parse(bundle)?;
    if let (Some(want), Identity::Node(name)) = (node, &b.identity) {
        if name != want {
            return Err(AuthError::WrongIdentity {
                path: PathBuf::from("<bundle>"),
                found: b.identity.clone(),
                wanted: Identity::Node(want.to_string()),
                hint: format!(
                    "issue one for this node with `ckptd ca issue {want}`, or set node_name = \"{name}\" in agent.toml"
                ),
            });
        }
    }
    make_dir(dir)?;
    write_private(dir, NODE_KEY, &b.key, 0o600)?;
    write_private(dir, NODE_CERT, &b.cert, 0o644)?;
    write_private(dir, CA_CERT, &b.ca, 0o644)?;
    Ok(b.identity)
}

/// The PEM blocks of a text, each with its BEGIN and END lines.
fn pem_blocks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if line.starts_with("-----BEGIN ") {
            cur = Some(String::new());
        }
        if let Some(c) = cur.as_mut() {
            c.push_str(line);
            c.push('\n');
        }
        if line.starts_with("-----END ") {
            if let Some(c) = cur.take() {
                out.push(c);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_issue_install_and_refusals() {
        let head = tempfile::tempdir().unwrap();
        init(head.path()).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&head.path().join(CA_KEY)), 0o600);
        assert_eq!(mode(&head.path().join(COORDINATOR_KEY)), 0o600);
        assert_eq!(mode(&head.path().join(CA_CERT)), 0o644);
        assert!(matches!(init(head.path()), Err(AuthError::CaExists { .. })));
        assert!(matches!(
            issue(head.path(), "../n1"),
            Err(AuthError::BadNodeName { .. })
        ));
        let bundle = issue(head.path(), "n1").unwrap();
        let node = tempfile::tempdir().unwrap();
        let e = install(&bundle, node.path(), Some("n2")).unwrap_err();
        assert!(e.to_string().contains("ckptd ca issue n2"), "{e}");
        assert!(!node.path().join(NODE_KEY).exists());
        let id = install(&bundle, node.path(), Some("n1")).unwrap();
        assert_eq!(id, Identity::Node("n1".into()));
        assert_eq!(mode(&node.path().join(NODE_KEY)), 0o600);
        let e = install("garbage", node.path(), None).unwrap_err();
        assert!(e.to_string().contains("no private key"), "{e}");
    }
}
