//! The job images on the host, as the agent remembers them: each job image's reference
//! pinned to its registry digest (what a job's container runs, so that a tag moved since
//! cannot change an attempt), the images this agent pulled (the only ones it may remove:
//! another is someone else's), and those the leases waiting to start need this round (never
//! removed). [`removable`] decides which to remove when the engine's disk runs low.

use std::collections::{BTreeMap, BTreeSet};

/// The images the agent tracks, part of its [`crate::Memory`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Images {
    /// A job image's reference → `repo@sha256:...`, learnt when the image was found or pulled.
    pinned: BTreeMap<String, String>,
    /// The ids of the job images this agent pulled.
    pulled: BTreeSet<String>,
    /// The ids of the images the leases waiting to start need, this round.
    wanted: BTreeSet<String>,
}

/// An image on the host, as the engine lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostImage<'a> {
    pub id: &'a str,
    /// Seconds since the epoch; 0 when unknown.
    pub created: i64,
    /// Whether a container, running or not, uses it.
    pub in_use: bool,
}

impl Images {
    /// A new round of looking for the waiting leases' images begins: none is wanted yet.
    pub fn new_round(&mut self) {
        self.wanted.clear();
    }

    /// The image `reference` is on the host as `id`, pinned to `pinned` (`None`: no
    /// registry knows it); a waiting lease needs it.
    pub fn found(&mut self, reference: &str, id: &str, pinned: Option<String>) {
        self.pin(reference, pinned);
        self.wanted.insert(id.to_owned());
    }

    /// This agent pulled `reference`, which is `id` on the host.
    pub fn pulled(&mut self, reference: &str, id: &str, pinned: Option<String>) {
        self.pin(reference, pinned);
        self.pulled.insert(id.to_owned());
    }

    /// The image `id` was removed.
    pub fn removed(&mut self, id: &str) {
        self.pulled.remove(id);
    }

    /// What a job naming `reference` runs: the digest it was pinned to, if any.
    pub fn pinned(&self, reference: &str) -> Option<&str> {
        self.pinned.get(reference).map(String::as_str)
    }

    /// Of the host's `images`, those to remove while the engine's disk is short, in the
    /// order to remove them (oldest first): the job images this agent pulled that no
    /// container uses and no waiting lease needs; never the replica's (`replica`, its id
    /// when it is there).
    pub fn removable<'a>(&self, images: &[HostImage<'a>], replica: Option<&str>) -> Vec<&'a str> {
        let mut old: Vec<&HostImage<'a>> = images
            .iter()
            .filter(|i| {
                self.pulled.contains(i.id)
                    && !i.in_use
                    && !self.wanted.contains(i.id)
                    && replica != Some(i.id)
            })
            .collect();
        old.sort_by_key(|i| i.created);
        old.into_iter().map(|i| i.id).collect()
    }

    fn pin(&mut self, reference: &str, pinned: Option<String>) {
        match pinned {
            Some(p) => self.pinned.insert(reference.to_owned(), p),
            None => self.pinned.remove(reference),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Memory;

    fn image(id: &str, created: i64, in_use: bool) -> HostImage<'_> {
        HostImage {
            id,
            created,
            in_use,
        }
    }

    #[test]
    fn only_unused_unwanted_images_this_agent_pulled_go_oldest_first_never_the_replicas() {
        let mut mem = Memory::default();
        for id in ["new", "old", "used", "wanted", "replica"] {
            mem.images.pulled(id, id, None);
        }
        mem.images.new_round();
        mem.images.found("wanted", "wanted", None);
        let host = [
            image("new", 300, false),
            image("old", 100, false),
            image("used", 50, true),
            image("wanted", 10, false),
            image("replica", 5, false),
            image("someone-elses", 1, false),
        ];
        assert_eq!(mem.images.removable(&host, Some("replica")), ["old", "new"]);
        // Once removed it is no longer this agent's to remove; in a new round the image
        // no lease needs any more may go.
        mem.images.removed("old");
        mem.images.new_round();
        assert_eq!(
            mem.images.removable(&host, Some("replica")),
            ["wanted", "new"]
        );
    }

    #[test]
    fn a_job_runs_its_image_as_pinned_when_found_or_pulled() {
        let mut images = Images::default();
        images.found("r/trainer:1", "sha256:a", Some("r/trainer@sha256:a".into()));
        assert_eq!(images.pinned("r/trainer:1"), Some("r/trainer@sha256:a"));
        // Moved and pulled again; an image no registry knows is not pinned.
        images.pulled("r/trainer:1", "sha256:b", Some("r/trainer@sha256:b".into()));
        assert_eq!(images.pinned("r/trainer:1"), Some("r/trainer@sha256:b"));
        images.found("local:dev", "sha256:c", None);
        assert_eq!(images.pinned("local:dev"), None);
    }
}
