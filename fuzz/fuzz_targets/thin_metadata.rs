#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| udm_fuzz::thin::thin_metadata(data));
