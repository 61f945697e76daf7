#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| udm_fuzz::replication_stream(data));
