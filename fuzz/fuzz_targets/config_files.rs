//! agent.toml and coordinator.toml, along the path `validate` and the services' start take:
//! `nightshift_configfile::check_text` against the typed struct, then the `config` crate's
//! load and the struct's own `validate`. Besides not panicking: every problem has a message
//! and a line inside the file, and a file the check passes also loads.
#![no_main]

use std::fmt::Debug;
use std::path::Path;

use libfuzzer_sys::fuzz_target;
use nightshift_agent::config::AgentConfig;
use nightshift_coordinator::config::CoordinatorConfig;
use serde::de::DeserializeOwned;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(cfg) = check::<AgentConfig>("agent.toml", text) {
        let _ = cfg.validate();
    }
    if let Some(cfg) = check::<CoordinatorConfig>("coordinator.toml", text) {
        let _ = cfg.validate();
    }
});

/// The file's check, then its load; the loaded struct when both pass.
fn check<T: DeserializeOwned + Debug>(name: &str, text: &str) -> Option<T> {
    let lines = text.split('\n').count();
    let checked = nightshift_configfile::check_text::<T>(Path::new(name), text);
    if let Err(problems) = &checked {
        assert!(!problems.0.is_empty(), "a refused file without a problem");
        for p in &problems.0 {
            assert!(
                !p.message.trim().is_empty(),
                "a problem without a message: {p:?}"
            );
            if let Some(line) = p.line {
                assert!(
                    line >= 1 && line <= lines,
                    "problem outside the file ({lines} lines): {p:?}"
                );
            }
        }
    }
    let loaded = config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml))
        .build()
        .and_then(|c| c.try_deserialize::<T>());
    if checked.is_ok() {
        assert!(
            loaded.is_ok(),
            "{name} passed the check but does not load: {loaded:?}"
        );
    }
    loaded.ok()
}
