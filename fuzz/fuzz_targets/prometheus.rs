//! The agent's Prometheus text parser (`Scrape::parse`) and what it reads from a vLLM page
//! (`VllmSnapshot::from_scrape`, the signals of a heartbeat). The agent decodes the body
//! lossily, as here. Besides not panicking: every error names a line of the page, every
//! sample has a name, and the signals serialise.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nightshift_agent::serving::prometheus::Scrape;
use nightshift_agent::serving::vllm::VllmSnapshot;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let scrape = Scrape::parse(&text);
    let lines = text.split('\n').count();
    for e in &scrape.errors {
        assert!(
            e.line >= 1 && e.line <= lines,
            "error outside the page ({lines} lines): {e:?}"
        );
        assert!(
            !e.reason.to_string().is_empty(),
            "an error without a reason: {e:?}"
        );
    }
    for s in &scrape.samples {
        assert!(!s.name.is_empty(), "a sample without a name: {s:?}");
        let _ = scrape.type_of(s.name);
    }
    let snapshot = VllmSnapshot::from_scrape(&scrape);
    let signals = snapshot.signals();
    serde_json::to_string(&signals).expect("the signals serialise");
});
