//! A job's `sandbox:` section: what it asks for beyond an unprivileged container with its
//! leased GPUs. Every field is refused by the coordinator's policy unless an admin allows it
//! (`[policy]` of coordinator.toml, or an admin token); the agent applies what was accepted.
//!
//! ```yaml
//! sandbox:
//!   privileged: false
//!   hostNetwork: true        # the host's network namespace (e.g. for InfiniBand)
//!   hostPid: false
//!   capAdd: [IPC_LOCK]
//!   devices: [/dev/infiniband/uverbs0]
//!   mounts:
//!     - host: /datasets/imagenet
//!       path: /data/imagenet
//!       readOnly: true       # the default
//! ```

use serde::{Deserialize, Serialize};

use crate::job::SpecError;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Sandbox {
    #[serde(default, skip_serializing_if = "is_false")]
    pub privileged: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_network: bool,
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_pid: bool,
    /// Linux capabilities to add (`IPC_LOCK`; a `CAP_` prefix is accepted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cap_add: Vec<String>,
    /// Host devices given to the container at the same path (`/dev/infiniband/uverbs0`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A host directory or file mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// The absolute path on the host.
    pub host: String,
    /// The absolute path in the container.
    pub path: String,
    /// Read-only unless set to false.
    #[serde(default = "yes")]
    pub read_only: bool,
}

fn is_false(v: &bool) -> bool {
    !*v
}

fn yes() -> bool {
    true
}

impl Sandbox {
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// Checks the shape of every field (absolute paths without `..`, capability names);
    /// whether policy allows them is the coordinator's business.
    pub fn validate(&self) -> Result<(), SpecError> {
        for (i, cap) in self.cap_add.iter().enumerate() {
            let name = capability(cap);
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                return Err(SpecError::new(
                    format!("sandbox.capAdd[{i}]"),
                    "must be a capability name in capitals, e.g. IPC_LOCK",
                ));
            }
        }
        for (i, device) in self.devices.iter().enumerate() {
            let field = format!("sandbox.devices[{i}]");
            let path = normal_path(device).map_err(|rule| SpecError::new(&field, rule))?;
            if !path.starts_with("/dev/") {
                return Err(SpecError::new(field, "must be a device under /dev/"));
            }
        }
        for (i, mount) in self.mounts.iter().enumerate() {
            normal_path(&mount.host)
                .map_err(|rule| SpecError::new(format!("sandbox.mounts[{i}].host"), rule))?;
            let path = normal_path(&mount.path)
                .map_err(|rule| SpecError::new(format!("sandbox.mounts[{i}].path"), rule))?;
            if path == "/" {
                return Err(SpecError::new(
                    format!("sandbox.mounts[{i}].path"),
                    "must not be the container's root",
                ));
            }
        }
        Ok(())
    }
}

/// A capability's name without its `CAP_` prefix.
pub fn capability(name: &str) -> &str {
    name.strip_prefix("CAP_").unwrap_or(name)
}

/// `path` absolute, with `.` and repeated `/` removed and no trailing `/`; refused when it is
/// relative, holds a `..` component, or characters Docker's bind syntax cannot carry.
pub fn normal_path(path: &str) -> Result<String, &'static str> {
    if !path.starts_with('/') {
        return Err("must be an absolute path");
    }
    if path.contains([':', ',', '\n', '\0']) {
        return Err("must not contain ':', ',' or control characters");
    }
    container_path(path)
}

/// A path in a container, as [`normal_path`] but with any character but NUL (a file placed
/// in a container by archive, a file read back from one).
pub fn container_path(path: &str) -> Result<String, &'static str> {
    if !path.starts_with('/') {
        return Err("must be an absolute path");
    }
    if path.contains('\0') {
        return Err("must not contain a NUL byte");
    }
    let mut parts = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("must not contain '..'"),
            part => parts.push(part),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// Whether normalised `path` is `prefix` or below it (by whole components, so `/data` does
/// not cover `/database`).
pub fn is_under(path: &str, prefix: &str) -> bool {
    prefix == "/"
        || path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalised_and_escapes_refused() {
        assert_eq!(normal_path("/data//set/./a/").unwrap(), "/data/set/a");
        assert_eq!(normal_path("/").unwrap(), "/");
        assert_eq!(
            normal_path("/data/../etc").unwrap_err(),
            "must not contain '..'"
        );
        assert_eq!(normal_path("data").unwrap_err(), "must be an absolute path");
        assert!(normal_path("/a:/b").is_err());
        assert!(is_under("/datasets/imagenet", "/datasets"));
        assert!(is_under("/datasets", "/datasets"));
        assert!(!is_under("/datasets-private", "/datasets"));
        assert!(is_under("/anything", "/"));
    }

    #[test]
    fn a_sandbox_reads_from_yaml_with_read_only_mounts_by_default() {
        let s: Sandbox = yaml_serde::from_str(
            "hostNetwork: true\ncapAdd: [CAP_IPC_LOCK]\nmounts:\n  - {host: /d, path: /data}\n",
        )
        .unwrap();
        assert!(s.host_network && !s.privileged);
        assert_eq!(
            s.mounts,
            [Mount {
                host: "/d".into(),
                path: "/data".into(),
                read_only: true
            }]
        );
        assert_eq!(capability(&s.cap_add[0]), "IPC_LOCK");
        s.validate().unwrap();
        let bad: Result<Sandbox, _> = yaml_serde::from_str("hostNetwrok: true\n");
        assert!(bad.unwrap_err().to_string().contains("hostNetwrok"));
    }

    #[test]
    fn each_field_is_checked() {
        let bad = |s: Sandbox| s.validate().unwrap_err().to_string();
        let mount = |host: &str, path: &str| Mount {
            host: host.into(),
            path: path.into(),
            read_only: true,
        };
        assert_eq!(
            bad(Sandbox {
                cap_add: vec!["sys admin".into()],
                ..Sandbox::default()
            }),
            "sandbox.capAdd[0]: must be a capability name in capitals, e.g. IPC_LOCK"
        );
        assert_eq!(
            bad(Sandbox {
                devices: vec!["/etc/passwd".into()],
                ..Sandbox::default()
            }),
            "sandbox.devices[0]: must be a device under /dev/"
        );
        assert_eq!(
            bad(Sandbox {
                mounts: vec![mount("/data/../etc", "/x")],
                ..Sandbox::default()
            }),
            "sandbox.mounts[0].host: must not contain '..'"
        );
        assert_eq!(
            bad(Sandbox {
                mounts: vec![mount("/data", "/")],
                ..Sandbox::default()
            }),
            "sandbox.mounts[0].path: must not be the container's root"
        );
    }
}
