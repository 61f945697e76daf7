//! Replication of thin snapshots between pools (`udm send` / `udm receive`): the stream
//! format, shared by the daemon (which reads and writes pools) and the client (which carries
//! streams between daemons, files and pipes).

pub mod stream;
