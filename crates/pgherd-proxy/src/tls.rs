//! TLS setup: the acceptor clients connect to, and the connector used towards servers.

use std::path::Path;
use std::sync::Arc;

use pgherd_config::{ClientTls, ServerTls, ServerTlsMode};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read certificates from {}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("bad certificate in {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("no certificate found in {}", path.display()));
    }
    Ok(certs)
}

fn load_roots(path: &Path) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots
            .add(cert)
            .map_err(|e| format!("unusable CA certificate in {}: {e}", path.display()))?;
    }
    Ok(roots)
}

/// Builds the TLS acceptor for client connections.
pub fn client_acceptor(settings: &ClientTls) -> Result<tokio_rustls::TlsAcceptor, String> {
    let certs = load_certs(&settings.cert_file)?;
    let key = PrivateKeyDer::from_pem_file(&settings.key_file).map_err(|e| {
        format!(
            "cannot read private key {}: {e}",
            settings.key_file.display()
        )
    })?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match &settings.client_ca_file {
        // Certificates are checked when presented; whether one is required is the hba rule's call.
        Some(ca) => builder.with_client_cert_verifier(
            WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("client CA {}: {e}", ca.display()))?,
        ),
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("certificate and key do not form a usable pair: {e}"))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Accepts any server certificate: `prefer` and `require` encrypt without authenticating, as
/// libpq's modes of the same names do.
#[derive(Debug)]
struct AcceptAnyServerCert(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AcceptAnyServerCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to the CA, but the name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Builds the connector for server connections, or `None` when TLS to servers is disabled.
pub fn server_connector(
    settings: &ServerTls,
) -> Result<Option<tokio_rustls::TlsConnector>, String> {
    if settings.mode == ServerTlsMode::Disable {
        return Ok(None);
    }
    let config = postgres_client_config(settings, true)?;
    Ok(Some(tokio_rustls::TlsConnector::from(Arc::new(config))))
}

/// TLS towards a PostgreSQL server: its certificate verified as `[server_tls]` says when
/// `verify` (verify-ca, verify-full), else accepted as libpq's `require` and `prefer` do.
pub fn postgres_client_config(
    settings: &ServerTls,
    verify: bool,
) -> Result<rustls::ClientConfig, String> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let verifier: Arc<dyn ServerCertVerifier> = match settings.mode {
        ServerTlsMode::VerifyCa | ServerTlsMode::VerifyFull if verify => {
            let ca = settings
                .ca_file
                .as_deref()
                .ok_or("verify-ca and verify-full need server_tls.ca_file")?;
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
                    .build()
                    .map_err(|e| format!("server CA {}: {e}", ca.display()))?;
            if settings.mode == ServerTlsMode::VerifyCa {
                Arc::new(ChainOnly(webpki))
            } else {
                webpki
            }
        }
        _ => Arc::new(AcceptAnyServerCert(provider())),
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// The common name of a client certificate's subject, for `cert` authentication.
///
/// Walks the DER just far enough to find the subject's CN (OID 2.5.4.3). A full X.509 parser is
/// not needed: by the time this runs rustls has verified the chain.
pub fn certificate_common_name(cert: &CertificateDer<'_>) -> Option<String> {
    const CN_OID: &[u8] = &[0x55, 0x04, 0x03];
    const OID_TAG: u8 = 0x06;
    let (_, certificate, _) = der_element(cert.as_ref())?;
    let (_, tbs) = *der_elements(certificate)?.first()?;
    let fields = der_elements(tbs)?;
    // tbsCertificate: [0] version (optional), serial, signature, issuer, validity, subject, ...
    let offset = usize::from(fields.first()?.0 == 0xa0);
    let (_, subject) = *fields.get(offset + 4)?;
    for (_, rdn) in der_elements(subject)? {
        for (_, attribute) in der_elements(rdn)? {
            if let [(OID_TAG, oid), (_, value), ..] = der_elements(attribute)?.as_slice() {
                if *oid == CN_OID {
                    return String::from_utf8(value.to_vec()).ok();
                }
            }
        }
    }
    None
}

/// Splits the contents of a constructed DER element into its (tag, contents) children.
fn der_elements(mut rest: &[u8]) -> Option<Vec<(u8, &[u8])>> {
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (tag, contents, tail) = der_element(rest)?;
        out.push((tag, contents));
        rest = tail;
    }
    Some(out)
}

/// One DER element: its tag, its contents and what follows it.
fn der_element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let tag = *input.first()?;
    let first_len = *input.get(1)?;
    let (len, header) = if first_len < 0x80 {
        (first_len as usize, 2)
    } else {
        let count = (first_len & 0x7f) as usize;
        if count == 0 || count > 4 {
            return None;
        }
        let bytes = input.get(2..2 + count)?;
        (
            bytes.iter().fold(0usize, |acc, b| (acc << 8) | *b as usize),
            2 + count,
        )
    };
    let end = header.checked_add(len)?;
    Some((tag, input.get(header..end)?, input.get(end..)?))
}
