//! Throwaway TLS material for tests: a CA, a server certificate for localhost and 127.0.0.1,
//! and client certificates whose common name is a user name.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

pub struct TestCerts {
    pub dir: PathBuf,
    pub ca_file: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl TestCerts {
    pub fn create(dir: &Path) -> TestCerts {
        std::fs::create_dir_all(dir).expect("cert dir");
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "pgherd test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params.self_signed(&ca_key).expect("CA cert");

        let server_key = KeyPair::generate().expect("server key");
        let mut server_params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .expect("server params");
        server_params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = server_params
            .signed_by(&server_key, &ca, &ca_key)
            .expect("server cert");

        let certs = TestCerts {
            dir: dir.to_owned(),
            ca_file: dir.join("ca.crt"),
            server_cert: dir.join("server.crt"),
            server_key: dir.join("server.key"),
            ca,
            ca_key,
        };
        write(&certs.ca_file, &certs.ca.pem());
        write(&certs.server_cert, &server.pem());
        write(&certs.server_key, &server_key.serialize_pem());
        certs
    }

    /// A client certificate for `user`; returns (certificate file, key file).
    pub fn client(&self, user: &str) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().expect("client key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
        params.distinguished_name.push(DnType::CommonName, user);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.ca, &self.ca_key)
            .expect("client cert");
        let cert_path = self.dir.join(format!("{user}.crt"));
        let key_path = self.dir.join(format!("{user}.key"));
        write(&cert_path, &cert.pem());
        write(&key_path, &key.serialize_pem());
        (cert_path, key_path)
    }
}

fn write(path: &Path, text: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    f.write_all(text.as_bytes()).expect("write cert");
}
