//! What udm's tests share, so that each crate's tests say what they check and not how to set
//! it up. A dev-dependency only: nothing here is part of udm.

mod temp_dir;

pub use temp_dir::TempDir;
