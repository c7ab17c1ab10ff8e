//! Whether a GPU may be leased, from the events and counters NVML reports: critical XID
//! events and ECC errors. Pure functions, shared by the NVML backend and the fake GPUs.
//!
//! The XID policy is the NVIDIA Kubernetes device plugin's (`internal/rm/health.go` in
//! NVIDIA/k8s-device-plugin): every critical XID event makes the GPU unhealthy except the
//! ones NVIDIA's XID catalog (<https://docs.nvidia.com/deploy/xid-errors/>) attributes to
//! the application rather than the GPU: 13, 31, 43, 45 and 68. An unhealthy verdict from an
//! XID is sticky for the life of the agent process: most critical XIDs need a GPU reset or a
//! reboot, after which the agent starts afresh.

/// XIDs that NVIDIA attributes to the application, not the GPU: the GPU stays healthy.
pub const APPLICATION_XIDS: [u64; 5] = [
    13, // graphics engine exception
    31, // gpu memory page fault
    43, // gpu stopped processing
    45, // preemptive cleanup, due to previous errors
    68, // video processor exception
];

/// What the XID catalog says of the critical XIDs seen most on data-centre GPUs, for the
/// reason shown to operators. Any other critical XID is reported by number alone.
const XID_DESCRIPTIONS: [(u64, &str); 14] = [
    (48, "double-bit ecc error"),
    (61, "internal micro-controller breakpoint"),
    (62, "internal micro-controller halt"),
    (63, "ecc page retirement or row remapping recorded"),
    (64, "ecc page retirement or row remapping failed"),
    (74, "nvlink error"),
    (79, "the gpu has fallen off the bus"),
    (92, "high single-bit ecc error rate"),
    (94, "contained ecc error"),
    (95, "uncontained ecc error"),
    (119, "gsp rpc timeout"),
    (120, "gsp error"),
    (140, "unrecovered ecc error"),
    (154, "gpu recovery action changed"),
];

/// The unhealthy reason a critical XID event gives, or `None` for an application XID.
pub fn xid_verdict(xid: u64) -> Option<String> {
    if APPLICATION_XIDS.contains(&xid) {
        return None;
    }
    Some(
        match XID_DESCRIPTIONS.iter().find(|(known, _)| *known == xid) {
            Some((_, description)) => format!("xid {xid}: {description}"),
            None => format!("xid {xid}"),
        },
    )
}

/// The ECC readings health depends on; `None` where the GPU does not support the counter
/// (ECC disabled, or a GPU without it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EccReadings {
    /// Uncorrectable ECC errors since the driver loaded.
    pub volatile_uncorrected: Option<u64>,
    /// Memory pages waiting to be retired at the next reset.
    pub pages_pending_retirement: Option<bool>,
}

/// The unhealthy reason the ECC readings give: any volatile uncorrectable error, or pages
/// pending retirement (the GPU needs a reset before its memory can be trusted). Unknown
/// readings never make a GPU unhealthy.
pub fn ecc_verdict(ecc: &EccReadings) -> Option<String> {
    let mut reasons = Vec::new();
    if let Some(errors @ 1..) = ecc.volatile_uncorrected {
        let plural = if errors == 1 { "" } else { "s" };
        reasons.push(format!("{errors} volatile uncorrectable ecc error{plural}"));
    }
    if ecc.pages_pending_retirement == Some(true) {
        reasons.push("retired pages pending (reset the gpu)".to_owned());
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// All the reasons a GPU is unhealthy, in the order given, as one; `None` when there is none.
pub fn unhealthy_reason(reasons: impl IntoIterator<Item = Option<String>>) -> Option<String> {
    let reasons: Vec<String> = reasons.into_iter().flatten().collect();
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn critical_xids_are_unhealthy_with_their_description() {
        assert_eq!(
            xid_verdict(79).as_deref(),
            Some("xid 79: the gpu has fallen off the bus")
        );
        assert_eq!(
            xid_verdict(48).as_deref(),
            Some("xid 48: double-bit ecc error")
        );
        for xid in [48, 63, 64, 74, 79, 92, 94, 95, 119, 120] {
            assert!(xid_verdict(xid).is_some(), "xid {xid}");
        }
        assert_eq!(xid_verdict(1234).as_deref(), Some("xid 1234"));
    }

    #[test]
    fn application_xids_leave_the_gpu_healthy() {
        for xid in APPLICATION_XIDS {
            assert_eq!(xid_verdict(xid), None, "xid {xid}");
        }
    }

    #[test]
    fn reasons_are_joined_in_order() {
        assert_eq!(unhealthy_reason([None, None]), None);
        assert_eq!(unhealthy_reason([]), None);
        assert_eq!(
            unhealthy_reason([
                Some("nvml: power: device requires a reset".into()),
                None,
                xid_verdict(79),
            ])
            .as_deref(),
            Some("nvml: power: device requires a reset; xid 79: the gpu has fallen off the bus")
        );
    }

    #[test]
    fn ecc_errors_and_pending_retirements_are_unhealthy() {
        let ecc = |volatile_uncorrected, pages_pending_retirement| EccReadings {
            volatile_uncorrected,
            pages_pending_retirement,
        };
        assert_eq!(ecc_verdict(&EccReadings::default()), None);
        assert_eq!(ecc_verdict(&ecc(Some(0), Some(false))), None);
        assert_eq!(
            ecc_verdict(&ecc(Some(1), None)).as_deref(),
            Some("1 volatile uncorrectable ecc error")
        );
        assert_eq!(
            ecc_verdict(&ecc(Some(3), Some(true))).as_deref(),
            Some("3 volatile uncorrectable ecc errors; retired pages pending (reset the gpu)")
        );
        assert_eq!(
            ecc_verdict(&ecc(None, Some(true))).as_deref(),
            Some("retired pages pending (reset the gpu)")
        );
    }
}
