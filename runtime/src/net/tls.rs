//! A TLS server configuration from PEM files, for the endpoints that serve
//! TLS themselves: a teacher's gRPC and REST, the watch page.

use std::sync::Arc;

/// Why a certificate chain and key make no TLS server configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("the certificate: {0}")]
    Certificate(tokio_rustls::rustls::pki_types::pem::Error),
    #[error("the certificate file holds no certificate")]
    NoCertificate,
    #[error("the key: {0}")]
    Key(tokio_rustls::rustls::pki_types::pem::Error),
    /// The crypto provider offers none of the protocol versions asked for.
    #[error("{0}")]
    Protocols(tokio_rustls::rustls::Error),
    #[error("the certificate and key: {0}")]
    CertificateAndKey(tokio_rustls::rustls::Error),
}

/// A TLS server configuration from a certificate chain and its key (PEM).
pub fn tls_config(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<Arc<tokio_rustls::rustls::ServerConfig>, TlsConfigError> {
    use tokio_rustls::rustls::{
        self,
        pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(TlsConfigError::Certificate)?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(TlsConfigError::Key)?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(TlsConfigError::Protocols)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(TlsConfigError::CertificateAndKey)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
