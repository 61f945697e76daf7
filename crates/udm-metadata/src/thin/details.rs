//! Device details: the value of the details tree (K:`struct disk_device_details`), 24 bytes.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | mapped_blocks |
//! | 8 | 8 | transaction_id (the pool's when the device was created) |
//! | 16 | 4 | creation_time |
//! | 20 | 4 | snapshotted_time |

pub const DETAILS_SIZE: usize = 24;

/// A thin device as the details tree records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceInfo {
    pub id: u32,
    /// Mappings in the device's tree.
    pub mapped_blocks: u64,
    pub transaction_id: u64,
    pub creation_time: u32,
    /// The pool's time when the device was last snapshotted (or created as a snapshot):
    /// mappings older than this may be shared.
    pub snapshotted_time: u32,
}

impl DeviceInfo {
    pub fn encode(&self) -> [u8; DETAILS_SIZE] {
        let mut v = [0u8; DETAILS_SIZE];
        v[0..8].copy_from_slice(&self.mapped_blocks.to_le_bytes());
        v[8..16].copy_from_slice(&self.transaction_id.to_le_bytes());
        v[16..20].copy_from_slice(&self.creation_time.to_le_bytes());
        v[20..24].copy_from_slice(&self.snapshotted_time.to_le_bytes());
        v
    }

    /// Whether the device is sealed, its newest mapping made at `newest_mapping` (None: it
    /// maps nothing): every mapping older than its last snapshot, so that any write to it maps
    /// a block anew at the pool's time, newer than them all. A write to a block whose mapping
    /// is newer is made in place and leaves no trace in the metadata. A device made as a
    /// snapshot is sealed; one written since is not (see [`super::ThinMetadata::seal`]).
    pub fn is_sealed(&self, newest_mapping: Option<u32>) -> bool {
        newest_mapping.is_none_or(|newest| newest < self.snapshotted_time)
    }

    pub fn decode(id: u32, v: &[u8]) -> Self {
        DeviceInfo {
            id,
            mapped_blocks: u64::from_le_bytes(v[0..8].try_into().unwrap()),
            transaction_id: u64::from_le_bytes(v[8..16].try_into().unwrap()),
            creation_time: u32::from_le_bytes(v[16..20].try_into().unwrap()),
            snapshotted_time: u32::from_le_bytes(v[20..24].try_into().unwrap()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_round_trip() {
        let info = DeviceInfo {
            id: 7,
            mapped_blocks: 1 << 40,
            transaction_id: 9,
            creation_time: 3,
            snapshotted_time: 5,
        };
        let v = info.encode();
        assert_eq!(&v[16..20], &3u32.to_le_bytes());
        assert_eq!(DeviceInfo::decode(7, &v), info);
    }
}
