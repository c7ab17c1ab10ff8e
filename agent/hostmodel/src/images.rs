//! The host's images: those it has, the registry it pulls from, and the pulls under way.
//!
//! An image is on the host unless it is marked missing (built or loaded there, known by no
//! registry); one published to the registry only once pulled. Pulling asks the registry, which knows
//! what was published (with the credentials it asks for); an image it does not know pulls
//! as the caller said ([`Pull`]), or is refused as unknown.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use nightshift_planner::Moment;

/// An image on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Image {
    /// The engine's id (`sha256:...`).
    pub id: String,
    /// `repo@sha256:...`, for an image pulled from a registry.
    pub repo_digests: Vec<String>,
    /// When it arrived, in pulls counted: the first pulled is the oldest.
    pub created: i64,
}

/// What pulling an image the registry does not know does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pull {
    /// It arrives after this long.
    Takes(Duration),
    /// It does not arrive while the model runs (a slow registry).
    Hangs,
    /// The registry refuses it after this long, for this reason.
    Fails(Duration, String),
}

/// An image in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Remote {
    /// `repo@sha256:...`.
    pinned: String,
    /// The tag it was published as.
    tag: String,
    /// The user and password it asks for, if any.
    credentials: Option<(String, String)>,
}

/// A pull under way.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pulling {
    image: String,
    /// When the engine's pull returns; `None`: not while the model runs.
    ends_at: Option<Moment>,
    /// The registry's refusal, if it refuses.
    refused: Option<String>,
}

/// The host's images and its registry.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Images {
    /// Pulled from the registry, by tag and by pinned reference.
    pulled: BTreeMap<String, Image>,
    /// Pinned reference → the tag it was pulled for.
    tags: BTreeMap<String, String>,
    /// Not on the host.
    missing: BTreeSet<String>,
    /// How pulling each image the registry does not know goes.
    plans: BTreeMap<String, Pull>,
    /// The registry's images, by `repo:tag` and by every `repo@digest` ever published.
    registry: BTreeMap<String, Remote>,
    /// The engine refuses to run these, saying why.
    refused: BTreeMap<String, String>,
    pulls: Vec<Pulling>,
    /// Pulls that returned, not yet taken in: the image and what it ended in.
    returned: Vec<(String, Result<(), String>)>,
    /// How long a pull from the registry takes.
    pub pull_takes: Duration,
    /// Pulls so far: each pulled image's creation time.
    clock: i64,
}

impl Images {
    /// `image` when it is on the host.
    pub fn get(&self, image: &str) -> Option<Image> {
        if let Some(info) = self.pulled.get(image) {
            return Some(info.clone());
        }
        self.has(image).then(|| Image {
            id: format!("sha256:fake-{image}"),
            ..Image::default()
        })
    }

    /// Whether `image` is on the host.
    pub fn has(&self, image: &str) -> bool {
        self.pulled.contains_key(image) || !self.missing.contains(image)
    }

    /// The engine's id of `image`, when it was pulled.
    pub(crate) fn id(&self, image: &str) -> Option<String> {
        self.pulled.get(image).map(|i| i.id.clone())
    }

    /// The tag a pinned reference was pulled for; any other image is its own.
    pub fn tag_of<'a>(&'a self, image: &'a str) -> &'a str {
        self.tags.get(image).map_or(image, String::as_str)
    }

    /// The images the host lacks.
    pub fn missing(&self) -> &BTreeSet<String> {
        &self.missing
    }

    /// Every image pulled, each once (by tag and pinned reference, it is one image).
    pub fn list(&self) -> Vec<Image> {
        let mut out: Vec<Image> = Vec::new();
        for info in self.pulled.values() {
            if !out.iter().any(|o| o.id == info.id) {
                out.push(info.clone());
            }
        }
        out
    }

    /// `image` is not on the host: running it fails until it is pulled.
    pub fn lose(&mut self, image: &str) {
        self.pulled.remove(image);
        self.missing.insert(image.to_owned());
    }

    /// The host lacks `image` and pulling it (not from the registry) does what `pull` says.
    pub(crate) fn lack(&mut self, image: &str, pull: Pull) {
        self.missing.insert(image.to_owned());
        self.plans.insert(image.to_owned(), pull);
    }

    /// `image` (`repo:tag`) is in the registry as `pinned` (`repo@sha256:...`), behind
    /// `credentials` when given, and not on the host. Publishing a tag again moves it; the
    /// host keeps what it pulled.
    pub fn publish(&mut self, image: &str, pinned: &str, credentials: Option<(&str, &str)>) {
        let remote = Remote {
            pinned: pinned.to_owned(),
            tag: image.to_owned(),
            credentials: credentials.map(|(u, p)| (u.to_owned(), p.to_owned())),
        };
        for name in [image, pinned] {
            if !self.pulled.contains_key(name) {
                self.missing.insert(name.to_owned());
            }
        }
        self.registry.insert(remote.pinned.clone(), remote.clone());
        self.registry.insert(image.to_owned(), remote);
    }

    /// The engine refuses to run `image`, saying `reason`.
    pub fn refuse(&mut self, image: &str, reason: &str) {
        self.refused.insert(image.to_owned(), reason.to_owned());
    }

    /// Why the engine refuses to run `image`, if it does.
    pub(crate) fn refusal(&self, image: &str) -> Option<&str> {
        self.refused.get(image).map(String::as_str)
    }

    /// Removes every name of the image `id` (garbage collection).
    pub(crate) fn remove(&mut self, id: &str) {
        let names: Vec<String> = self
            .pulled
            .iter()
            .filter(|(_, i)| i.id == id)
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            self.lose(&name);
        }
    }

    /// Starts pulling `image` as `user` with `password`, unless that is under way; returns
    /// when the pull returns (`None`: not while the model runs).
    pub(crate) fn start(
        &mut self,
        image: &str,
        auth: Option<(&str, &str)>,
        now: Moment,
    ) -> Option<Moment> {
        if let Some(p) = self.pulls.iter().find(|p| p.image == image) {
            return p.ends_at;
        }
        let (ends_at, refused) = match (self.registry.get(image), self.plans.get(image)) {
            (Some(remote), _) => {
                let allowed = remote.credentials.as_ref().is_none_or(|(u, p)| {
                    auth.is_some_and(|(au, ap)| (au, ap) == (u.as_str(), p.as_str()))
                });
                let refused = (!allowed).then(|| "unauthorized: authentication required".into());
                (Some(now + self.pull_takes), refused)
            }
            (None, Some(Pull::Takes(d))) => (Some(now + *d), None),
            (None, Some(Pull::Hangs)) => (None, None),
            (None, Some(Pull::Fails(d, why))) => (Some(now + *d), Some(why.clone())),
            (None, None) => (Some(now + self.pull_takes), Some("manifest unknown".into())),
        };
        self.pulls.push(Pulling {
            image: image.to_owned(),
            ends_at,
            refused,
        });
        ends_at
    }

    /// A pull of `image` under way starts over from `now`, as its plan now says.
    pub(crate) fn restart(&mut self, image: &str, now: Moment) {
        if let Some(i) = self.pulls.iter().position(|p| p.image == image) {
            self.pulls.remove(i);
            self.start(image, None, now);
        }
    }

    /// When the next pull returns.
    pub(crate) fn next_event(&self) -> Option<Moment> {
        self.pulls.iter().filter_map(|p| p.ends_at).min()
    }

    /// Ends the pulls due by `now`; true when one did.
    pub(crate) fn advance(&mut self, now: Moment) -> bool {
        if self.pulls.is_empty() {
            return false;
        }
        let (done, pulling) = std::mem::take(&mut self.pulls)
            .into_iter()
            .partition(|p| p.ends_at.is_some_and(|t| t <= now));
        self.pulls = pulling;
        let any = !done.is_empty();
        for p in done {
            let result = match p.refused {
                Some(why) => Err(why),
                None => {
                    self.arrive(&p.image);
                    Ok(())
                }
            };
            self.returned.push((p.image, result));
        }
        any
    }

    /// `image` arrived from its pull: pinned as the registry published it, if it did.
    fn arrive(&mut self, image: &str) {
        self.missing.remove(image);
        let Some(remote) = self.registry.get(image).cloned() else {
            return;
        };
        self.clock += 1;
        let info = Image {
            id: format!(
                "sha256:fake-{}",
                remote.pinned.split_once('@').map_or("", |(_, d)| d)
            ),
            repo_digests: vec![remote.pinned.clone()],
            created: self.clock,
        };
        self.missing.remove(&remote.pinned);
        self.tags.insert(remote.pinned.clone(), remote.tag.clone());
        self.pulled.insert(image.to_owned(), info.clone());
        self.pulled.insert(remote.pinned, info);
    }

    /// The pulls that returned since the last call: each image, with the registry's refusal
    /// when it refused.
    pub(crate) fn take_returned(&mut self) -> Vec<(String, Result<(), String>)> {
        std::mem::take(&mut self.returned)
    }

    /// What the pull of `image` returned, once it did.
    pub(crate) fn take_one(&mut self, image: &str) -> Option<Result<Image, String>> {
        let i = self.returned.iter().position(|(im, _)| im == image)?;
        let (_, result) = self.returned.remove(i);
        Some(result.map(|()| self.get(image).unwrap_or_default()))
    }
}
