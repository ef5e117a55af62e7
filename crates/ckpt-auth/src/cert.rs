//! Reading certificates: what [`ca`](crate::ca) needs to take a bundle apart and
//! [`tls`](crate::tls) needs to check whom a verified certificate names. Imports neither.
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;

use crate::Identity;

/// The DER of the first PEM certificate in `pem`.
pub fn pem_to_der(pem: &str) -> Result<Vec<u8>, String> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .map(|c| c.as_ref().to_vec())
        .map_err(|e| format!("not a PEM certificate: {e}"))
}

/// The subject common name of a DER certificate.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

/// The identity a DER certificate names (trust it only once its chain was verified).
pub fn identity_of(der: &[u8]) -> Option<Identity> {
    Identity::from_common_name(&common_name(der)?)
}
