//! Signatures by a daemon's cluster key, checked by others against the cluster CA: how the
//! coordinator hands a node authority it holds (a relay's grant over an epoch, see
//! `Agent.Epoch`) that the nodes receiving it can check without asking the coordinator.
//!
//! The key is the credential's own (ECDSA P-256, as `ckptd ca` issues them); a signature is
//! ECDSA P-256 with SHA-256 in ASN.1 DER. The checker trusts the signing certificate only once
//! rustls' verifier has chained it to the cluster CA and it names the expected identity.
use ring::rand::SystemRandom;
use ring::signature::{
    EcdsaKeyPair, UnparsedPublicKey, ECDSA_P256_SHA256_ASN1, ECDSA_P256_SHA256_ASN1_SIGNING,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use rustls::server::WebPkiClientVerifier;

use crate::cert::identity_of;
use crate::tls::{provider, Credential};
use crate::Identity;

/// Why a signature was not accepted, or could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SignatureError(String);

impl Credential {
    /// Signs `message` with this credential's key; returns the signature and this credential's
    /// certificate (DER), which the checker needs.
    pub fn sign(&self, message: &[u8]) -> Result<(Vec<u8>, Vec<u8>), SignatureError> {
        let PrivateKeyDer::Pkcs8(key) = self.key.as_ref() else {
            return Err(SignatureError(
                "the credential's key is not PKCS#8 (issue it with `ckptd ca`)".into(),
            ));
        };
        let rng = SystemRandom::new();
        let pair = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_ASN1_SIGNING,
            key.secret_pkcs8_der(),
            &rng,
        )
        .map_err(|e| {
            SignatureError(format!(
                "the credential's key is not an ECDSA P-256 key ({e}); issue it with `ckptd ca`"
            ))
        })?;
        let sig = pair
            .sign(&rng, message)
            .map_err(|e| SignatureError(format!("signing failed: {e}")))?;
        Ok((sig.as_ref().to_vec(), self.chain[0].as_ref().to_vec()))
    }

    /// Checks that `signature` over `message` was made by the key of `issuer` (a DER
    /// certificate), that this cluster's CA issued `issuer` and it is valid now, and that it
    /// names `signer`.
    pub fn check_signed(
        &self,
        issuer: &[u8],
        message: &[u8],
        signature: &[u8],
        signer: &Identity,
    ) -> Result<(), SignatureError> {
        let cert = CertificateDer::from(issuer);
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots.clone(), provider())
            .build()
            .map_err(|e| SignatureError(format!("cannot check certificates: {e}")))?;
        verifier
            .verify_client_cert(&cert, &[], UnixTime::now())
            .map_err(|e| {
                SignatureError(format!(
                    "the signing certificate is not one of this cluster's CA: {e}"
                ))
            })?;
        match identity_of(issuer) {
            Some(id) if &id == signer => {}
            found => {
                return Err(SignatureError(format!(
                    "signed by {}, not by {signer}",
                    found.map_or_else(|| "no ckpt identity".to_string(), |i| i.to_string())
                )))
            }
        }
        let (_, parsed) = x509_parser::parse_x509_certificate(issuer)
            .map_err(|e| SignatureError(format!("unreadable signing certificate: {e}")))?;
        let key = parsed.public_key().subject_public_key.data.as_ref();
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, key)
            .verify(message, signature)
            .map_err(|_| {
                SignatureError(format!(
                    "the signature does not check against the certificate of {signer}"
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca;

    fn node(dir: &std::path::Path, name: &str) -> Credential {
        let b = ca::issue(dir, name).unwrap();
        Credential::from_bundle(&ca::Bundle::parse(&b).unwrap()).unwrap()
    }

    #[test]
    fn a_coordinators_signature_checks_and_nothing_else_does() {
        let d = tempfile::tempdir().unwrap();
        ca::init(d.path()).unwrap();
        let coord = Credential::load(d.path(), &Identity::Coordinator).unwrap();
        let n1 = node(d.path(), "n1");
        let (sig, issuer) = coord.sign(b"job 7 epoch 3").unwrap();
        n1.check_signed(&issuer, b"job 7 epoch 3", &sig, &Identity::Coordinator)
            .unwrap();
        // Another message, a damaged signature.
        let e = n1
            .check_signed(&issuer, b"job 8 epoch 3", &sig, &Identity::Coordinator)
            .unwrap_err();
        assert!(e.0.contains("does not check"), "{e}");
        let mut bad = sig.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(n1
            .check_signed(&issuer, b"job 7 epoch 3", &bad, &Identity::Coordinator)
            .is_err());
        // A node signs with its own valid credential: not the coordinator.
        let (sig, issuer) = n1.sign(b"job 7 epoch 3").unwrap();
        let e = node(d.path(), "n2")
            .check_signed(&issuer, b"job 7 epoch 3", &sig, &Identity::Coordinator)
            .unwrap_err();
        assert!(e.0.contains("signed by node n1"), "{e}");
    }

    #[test]
    fn a_coordinator_of_another_cluster_is_refused() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        ca::init(a.path()).unwrap();
        ca::init(b.path()).unwrap();
        let theirs = Credential::load(b.path(), &Identity::Coordinator).unwrap();
        let (sig, issuer) = theirs.sign(b"m").unwrap();
        let e = node(a.path(), "n1")
            .check_signed(&issuer, b"m", &sig, &Identity::Coordinator)
            .unwrap_err();
        assert!(e.0.contains("not one of this cluster's CA"), "{e}");
    }
}
