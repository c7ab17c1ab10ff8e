//! The agent protocol's JSON as each side deserialises it: the coordinator reads
//! `RegisterRequest` and `Heartbeat`, the agent reads `RegisterReply` and `DesiredNode`.
//! Besides not panicking: whatever parses round-trips through serde unchanged.
#![no_main]

use std::fmt::Debug;

use libfuzzer_sys::fuzz_target;
use nightshift_common::{DesiredNode, Heartbeat, RegisterReply, RegisterRequest};
use serde::Serialize;
use serde::de::DeserializeOwned;

fuzz_target!(|data: &[u8]| {
    round_trip::<RegisterRequest>(data);
    round_trip::<Heartbeat>(data);
    round_trip::<RegisterReply>(data);
    round_trip::<DesiredNode>(data);
});

fn round_trip<T: Serialize + DeserializeOwned + PartialEq + Debug>(data: &[u8]) {
    match serde_json::from_slice::<T>(data) {
        Ok(value) => {
            let json = serde_json::to_vec(&value).expect("a parsed message serialises");
            let back: T = serde_json::from_slice(&json).expect("its JSON parses");
            assert_eq!(
                back,
                value,
                "round trip changed the message: {}",
                String::from_utf8_lossy(&json)
            );
        }
        Err(e) => assert!(!e.to_string().is_empty(), "an error without a message"),
    }
}
