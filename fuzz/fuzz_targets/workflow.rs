//! The Argo workflow file, along the path `nightshift lint` and `POST /v1/pipelines` take:
//! `nightshift_pipeline::load` (yaml::parse, decode, lint), then `Run::start` as the
//! coordinator does. Besides not panicking: a refusal carries at least one finding, each
//! with a message and a line inside the file, and loading is deterministic.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use nightshift_pipeline::{Run, yaml};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(doc) = yaml::parse(text) {
        let _ = doc.to_json();
    }
    // YAML breaks lines at `\n`, `\r\n` and a lone `\r`; an error at the end of the file
    // may name the line after the last.
    let breaks =
        text.matches('\n').count() + text.matches('\r').count() - text.matches("\r\n").count();
    let lines = breaks + 1;
    match nightshift_pipeline::load(text) {
        Ok(wf) => {
            assert_eq!(
                nightshift_pipeline::load(text).ok().as_ref(),
                Some(&wf),
                "load is not deterministic"
            );
            if let Ok(run) = Run::start(wf, "1", &BTreeMap::new(), 0) {
                let _ = run.next_deadline();
            }
        }
        Err(diags) => {
            assert!(!diags.is_empty(), "a refused workflow without a finding");
            for d in &diags.0 {
                assert!(
                    !d.message.trim().is_empty(),
                    "a finding without a message: {d:?}"
                );
                assert!(
                    d.line >= 1 && d.line <= lines + 1,
                    "finding outside the file ({lines} lines): {d:?}"
                );
            }
        }
    }
});
