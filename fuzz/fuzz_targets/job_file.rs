//! The job file, as the CLI (`JobSpec::from_yaml`, YAML or JSON) and the API
//! (`serde_json` then `validate`) parse it. Besides not panicking: an accepted file
//! round-trips through JSON and YAML unchanged, and a refusal names a field and a rule.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nightshift_common::{JobSpec, SpecError};

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        check(JobSpec::from_yaml(text));
    }
    let api =
        serde_json::from_slice::<JobSpec>(data).map_err(|e| SpecError::new("body", e.to_string()));
    check(api.and_then(|spec| spec.validate().map(|()| spec)));
});

fn check(parsed: Result<JobSpec, SpecError>) {
    match parsed {
        Ok(spec) => {
            let json = serde_json::to_string(&spec).expect("an accepted job serialises to JSON");
            let back: JobSpec = serde_json::from_str(&json).expect("its JSON parses");
            assert_eq!(back, spec, "JSON round trip changed the job");
            let yaml = yaml_serde::to_string(&spec).expect("an accepted job serialises to YAML");
            let back = JobSpec::from_yaml(&yaml).expect("its YAML is accepted");
            assert_eq!(back, spec, "YAML round trip changed the job");
        }
        Err(e) => {
            assert!(!e.field.is_empty(), "an error without a field: {e:?}");
            assert!(!e.rule.trim().is_empty(), "an error without a rule: {e:?}");
        }
    }
}
