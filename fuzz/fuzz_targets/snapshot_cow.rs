#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| udm_fuzz::snapshot_cow(data));
