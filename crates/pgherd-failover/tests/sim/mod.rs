pub mod agreement;
pub mod cluster;
pub mod etcd;
pub mod instance;
pub mod invariants;
