//! A daemon's credential and the rustls configurations built from it.
//!
//! Only TLS 1.3, only the cluster CA as trust anchor. A server asks every client for a
//! certificate but lets one without in (a job's `ckpt-rsh` has none; the handlers give such a
//! caller only the calls its job token authorizes). A client checks the server's chain and then
//! that the server is the identity it dialled: a node that holds a valid credential of its own
//! still cannot pose as the coordinator or as another node.
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

use crate::ca::{self, CLUSTER_NAME};
use crate::cert::identity_of;
use crate::{AuthError, Identity};

pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(e: impl std::fmt::Display) -> AuthError {
    AuthError::Tls(e.to_string())
}

/// The trust anchors: the cluster CA certificate at `path`.
pub fn load_roots(path: &Path) -> Result<Arc<RootCertStore>, AuthError> {
    let certs = read_certs(path)?;
    let mut roots = RootCertStore::empty();
    for c in certs {
        roots.add(c).map_err(|e| AuthError::Bad {
            path: path.to_path_buf(),
            problem: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(Arc::new(roots))
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, AuthError> {
    let bytes = std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            AuthError::Bad {
                path: path.to_path_buf(),
                problem: "missing: create the cluster CA with `ckptd ca init` on the head node and enroll this node with `ckptd ca issue NODE | ckpt-agent enroll -` (docs/security.md)".into(),
            }
        } else {
            AuthError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| AuthError::Bad {
            path: path.to_path_buf(),
            problem: format!("unreadable PEM: {e}"),
        })?;
    if certs.is_empty() {
        return Err(AuthError::Bad {
            path: path.to_path_buf(),
            problem: "no certificate in it".into(),
        });
    }
    Ok(certs)
}

/// A daemon's credential: its certificate and key, and the cluster CA.
#[derive(Debug, Clone)]
pub struct Credential {
    pub(crate) identity: Identity,
    pub(crate) chain: Vec<CertificateDer<'static>>,
    pub(crate) key: Arc<PrivateKeyDer<'static>>,
    pub(crate) roots: Arc<RootCertStore>,
}

impl Credential {
    /// Loads the credential of `identity` from `dir` (the coordinator's `ckptd.pem`/`ckptd.key`
    /// or the node's `node.pem`/`node.key`, and `ca.pem`), and checks that the certificate
    /// names that identity: an agent whose `node_name` differs from its credential's name does
    /// not start.
    pub fn load(dir: &Path, identity: &Identity) -> Result<Credential, AuthError> {
        let (cert_name, key_name) = match identity {
            Identity::Coordinator => (ca::COORDINATOR_CERT, ca::COORDINATOR_KEY),
            Identity::Node(_) => (ca::NODE_CERT, ca::NODE_KEY),
        };
        let roots = load_roots(&dir.join(ca::CA_CERT))?;
        let cert_path = dir.join(cert_name);
        let chain = read_certs(&cert_path)?;
        let found = identity_of(&chain[0]).ok_or_else(|| AuthError::Bad {
            path: cert_path.clone(),
            problem: "not a certificate of a ckpt cluster CA".into(),
        })?;
        if &found != identity {
            let hint = match identity {
                Identity::Node(n) => format!(
                    "issue this node's with `ckptd ca issue {n} | ckpt-agent enroll -`, or set node_name to the credential's name"
                ),
                Identity::Coordinator => "this is not the coordinator's credential".into(),
            };
            return Err(AuthError::WrongIdentity {
                path: cert_path,
                found,
                wanted: identity.clone(),
                hint,
            });
        }
        let key_path = dir.join(key_name);
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| AuthError::Bad {
            path: key_path.clone(),
            problem: format!("unreadable private key: {e}"),
        })?;
        Ok(Credential {
            identity: identity.clone(),
            chain,
            key: Arc::new(key),
            roots,
        })
    }

    /// A node's credential straight from a bundle of [`ca::issue`], without files (tools and
    /// benchmarks that stand up many agents).
    pub fn from_bundle(bundle: &ca::Bundle) -> Result<Credential, AuthError> {
        let bad = |problem: String| AuthError::Bad {
            path: "<bundle>".into(),
            problem,
        };
        let mut roots = RootCertStore::empty();
        roots
            .add(
                CertificateDer::from_pem_slice(bundle.ca.as_bytes())
                    .map_err(|e| bad(e.to_string()))?,
            )
            .map_err(|e| bad(e.to_string()))?;
        let cert = CertificateDer::from_pem_slice(bundle.cert.as_bytes())
            .map_err(|e| bad(e.to_string()))?;
        let key =
            PrivateKeyDer::from_pem_slice(bundle.key.as_bytes()).map_err(|e| bad(e.to_string()))?;
        Ok(Credential {
            identity: bundle.identity.clone(),
            chain: vec![cert],
            key: Arc::new(key),
            roots: Arc::new(roots),
        })
    }

    /// Whose credential this is.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The cluster CA.
    pub fn roots(&self) -> &Arc<RootCertStore> {
        &self.roots
    }

    /// A server: presents this credential and verifies the client's certificate when there is
    /// one (see the module documentation for callers without).
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, AuthError> {
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .allow_unauthenticated()
            .build()
            .map_err(tls_err)?;
        let mut cfg = ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls_err)?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// A client that presents this credential to a server that must be `server`.
    pub fn client_config(&self, server: Identity) -> Result<Arc<ClientConfig>, AuthError> {
        client_config(
            &self.roots,
            server,
            Some((self.chain.clone(), self.key.clone_key())),
        )
    }
}

/// A client that presents no certificate (a job's `ckpt-rsh`) to a server that must be
/// `server`.
pub fn anonymous_client_config(
    roots: &Arc<RootCertStore>,
    server: Identity,
) -> Result<Arc<ClientConfig>, AuthError> {
    client_config(roots, server, None)
}

fn client_config(
    roots: &Arc<RootCertStore>,
    server: Identity,
    cert: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
) -> Result<Arc<ClientConfig>, AuthError> {
    let inner = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .map_err(tls_err)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ExpectIdentity {
            inner,
            expect: server,
        }));
    let mut cfg = match cert {
        Some((chain, key)) => builder.with_client_auth_cert(chain, key).map_err(tls_err)?,
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// Checks the server's chain with rustls' own verifier (against the one name every credential
/// carries), then that the certificate names the expected identity.
#[derive(Debug)]
struct ExpectIdentity {
    inner: Arc<WebPkiServerVerifier>,
    expect: Identity,
}

impl ServerCertVerifier for ExpectIdentity {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let name = ServerName::try_from(CLUSTER_NAME).expect("a valid DNS name");
        self.inner
            .verify_server_cert(end_entity, intermediates, &name, ocsp_response, now)?;
        match identity_of(end_entity) {
            Some(id) if id == self.expect => Ok(ServerCertVerified::assertion()),
            found => Err(rustls::Error::General(format!(
                "the server's credential is {}, not {}",
                found.map_or_else(|| "no ckpt identity".to_string(), |i| i.to_string()),
                self.expect
            ))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
