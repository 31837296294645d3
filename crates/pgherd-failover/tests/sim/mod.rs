pub mod cluster;
pub mod etcd;
