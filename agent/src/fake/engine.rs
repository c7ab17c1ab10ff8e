//! The fake container engine: containers that start, run, exit on their own, take their stop
//! signal or ignore it until the grace period's kill.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::time::Instant;

use super::{FakeContainer, Start, World, gpu_indices, lock};
use crate::engine::registry::{RegistryAuth, registry_of};
use crate::engine::{
    Container, ContainerSpec, ContainerState, Engine, EngineError, ImageInfo, LogStream,
};

/// A call made through the [`Engine`] port that changes the world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineCall {
    Run {
        name: String,
        image: String,
    },
    /// A pull, with the user it authenticated as.
    Pull {
        image: String,
        user: Option<String>,
    },
    Stop {
        id: String,
        grace: Duration,
    },
    Signal {
        id: String,
        signal: String,
    },
    Remove {
        id: String,
    },
    RemoveImage {
        id: String,
    },
}

/// The [`Engine`] port of a [`super::FakeNode`].
pub struct FakeEngine {
    world: Arc<Mutex<World>>,
}

impl FakeEngine {
    pub(super) fn new(world: Arc<Mutex<World>>) -> Self {
        Self { world }
    }
}

impl Engine for FakeEngine {
    async fn version(&self) -> Result<String, EngineError> {
        Ok("Fake 1.0 (in memory)".to_owned())
    }

    async fn list(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Container>, EngineError> {
        let mut w = lock(&self.world);
        if w.engine_down {
            return Err(EngineError::Other(
                "Cannot connect to the Docker daemon (the fake engine is stopped)".to_owned(),
            ));
        }
        w.settle();
        Ok(w.containers
            .values()
            .filter(|c| {
                labels
                    .iter()
                    .all(|(k, v)| c.container.labels.get(k) == Some(v))
            })
            .map(|c| c.container.clone())
            .collect())
    }

    async fn image(&self, image: &str) -> Result<Option<ImageInfo>, EngineError> {
        let w = lock(&self.world);
        Ok(w.image(image))
    }

    async fn pull(
        &self,
        image: &str,
        auth: Option<&RegistryAuth>,
    ) -> Result<ImageInfo, EngineError> {
        let takes = {
            let mut w = lock(&self.world);
            w.engine_calls.push(EngineCall::Pull {
                image: image.to_owned(),
                user: auth.map(|a| a.username.clone()),
            });
            w.pull_takes
        };
        tokio::time::sleep(takes).await;
        let mut w = lock(&self.world);
        let failed = |reason: &str| EngineError::PullFailed {
            image: image.to_owned(),
            registry: registry_of(image),
            reason: reason.to_owned(),
        };
        let Some(remote) = w.registry.get(image).cloned() else {
            return Err(failed("manifest unknown"));
        };
        if let Some((user, password)) = &remote.credentials
            && auth.is_none_or(|a| (&a.username, &a.password) != (user, password))
        {
            return Err(failed("unauthorized: authentication required"));
        }
        let pinned = remote.pinned.clone();
        w.clock += 1;
        let info = ImageInfo {
            id: format!(
                "sha256:fake-{}",
                pinned.split_once('@').map_or("", |(_, d)| d)
            ),
            repo_digests: vec![pinned.clone()],
            created: w.clock,
            in_use: false,
        };
        w.missing_images.remove(image);
        w.pinned.insert(pinned.clone(), remote.tag.clone());
        w.images.insert(image.to_owned(), info.clone());
        w.images.insert(pinned, info.clone());
        Ok(info)
    }

    async fn images(&self) -> Result<Vec<ImageInfo>, EngineError> {
        let w = lock(&self.world);
        let used: Vec<&str> = w
            .containers
            .values()
            .filter_map(|c| c.container.image_id.as_deref())
            .collect();
        let mut out: Vec<ImageInfo> = Vec::new();
        for info in w.images.values() {
            if !out.iter().any(|o| o.id == info.id) {
                out.push(ImageInfo {
                    in_use: used.contains(&info.id.as_str()),
                    ..info.clone()
                });
            }
        }
        Ok(out)
    }

    async fn remove_image(&self, id: &str) -> Result<(), EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        if w.containers
            .values()
            .any(|c| c.container.image_id.as_deref() == Some(id))
        {
            return Ok(());
        }
        w.engine_calls
            .push(EngineCall::RemoveImage { id: id.to_owned() });
        let names: Vec<String> = w
            .images
            .iter()
            .filter(|(_, i)| i.id == id)
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            w.images.remove(&name);
            w.missing_images.insert(name);
        }
        Ok(())
    }

    async fn data_root(&self) -> Result<Option<std::path::PathBuf>, EngineError> {
        Ok(Some("/var/lib/docker".into()))
    }

    async fn inspect(&self, id: &str) -> Result<Container, EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        w.containers
            .get(id)
            .map(|c| c.container.clone())
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))
    }

    async fn run(&self, spec: &ContainerSpec) -> Result<String, EngineError> {
        let existing = {
            let mut w = lock(&self.world);
            w.settle();
            w.engine_calls.push(EngineCall::Run {
                name: spec.name.clone(),
                image: spec.image.clone(),
            });
            if w.image(&spec.image).is_none() {
                return Err(EngineError::ImageMissing(spec.image.clone()));
            }
            if let Some(reason) = w.refused_images.get(&spec.image) {
                return Err(EngineError::Refused {
                    container: spec.name.clone(),
                    reason: reason.clone(),
                });
            }
            w.containers
                .values()
                .find(|c| c.container.name == spec.name)
                .map(|c| (c.container.id.clone(), c.running()))
        };
        // As Docker's adapter: a running container of that name is the one; a stopped one
        // is removed first.
        match existing {
            Some((id, true)) => return Ok(id),
            Some((id, false)) => self.remove(&id).await?,
            None => {}
        }
        let mut w = lock(&self.world);
        let n = w.next_id;
        w.next_id += 1;
        let id = format!("fake{n:06}");
        // A pinned image behaves as the tag it was pulled for.
        let tag = w.pinned.get(&spec.image).unwrap_or(&spec.image);
        let behaviour = w.behaviours.get(tag).cloned().unwrap_or_default();
        let image_id = w.image(&spec.image).map(|i| i.id);
        let now = Instant::now();
        let mut files: BTreeMap<String, Vec<u8>> = spec.files.iter().cloned().collect();
        files.extend(behaviour.files.iter().cloned());
        let container = Container {
            id: id.clone(),
            name: spec.name.clone(),
            image: spec.image.clone(),
            image_id,
            labels: spec.labels.clone(),
            state: ContainerState::Running,
            published_port: spec.publish.as_ref().map(|p| match p.host_port {
                0 => 30_000 + n as u16,
                port => port,
            }),
        };
        let gpus = gpu_indices(&spec.gpus);
        let held_bytes = gpus.iter().map(|g| w.memory_used(*g)).max().unwrap_or(0);
        w.starts.push(Start {
            id: id.clone(),
            labels: spec.labels.clone(),
            gpus,
            held_bytes,
        });
        w.containers.insert(
            id.clone(),
            FakeContainer {
                container,
                gpus: gpu_indices(&spec.gpus),
                ends: behaviour
                    .exits_after
                    .map(|(after, code)| (now + after, code)),
                behaviour,
                started_at: now,
                ended_at: None,
                files,
                asleep: false,
            },
        );
        Ok(id)
    }

    async fn signal(&self, id: &str, signal: &str) -> Result<(), EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        w.engine_calls.push(EngineCall::Signal {
            id: id.to_owned(),
            signal: signal.to_owned(),
        });
        let c = w
            .containers
            .get_mut(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
        if c.running() && !c.behaviour.ignores_signal {
            let at = Instant::now() + c.behaviour.exits_on_signal_after;
            if c.ends.is_none_or(|(e, _)| at < e) {
                c.ends = Some((at, c.behaviour.signal_exit_code));
            }
        }
        Ok(())
    }

    async fn stop(&self, id: &str, grace: Duration) -> Result<(), EngineError> {
        let end = {
            let mut w = lock(&self.world);
            w.settle();
            w.engine_calls.push(EngineCall::Stop {
                id: id.to_owned(),
                grace,
            });
            let c = w
                .containers
                .get_mut(id)
                .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
            if !c.running() {
                return Ok(());
            }
            let now = Instant::now();
            let killed = (now + grace, 137);
            let on_signal = (!c.behaviour.ignores_signal).then(|| {
                (
                    now + c.behaviour.exits_on_signal_after,
                    c.behaviour.signal_exit_code,
                )
            });
            let end = [c.ends, on_signal, Some(killed)]
                .into_iter()
                .flatten()
                .min_by_key(|(at, _)| *at)
                .unwrap_or(killed);
            c.ends = Some(end);
            end.0
        };
        tokio::time::sleep_until(end).await;
        lock(&self.world).settle();
        Ok(())
    }

    async fn remove(&self, id: &str) -> Result<(), EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        w.engine_calls
            .push(EngineCall::Remove { id: id.to_owned() });
        let Some(c) = w.containers.remove(id) else {
            return Ok(());
        };
        // The driver may still show its memory for a while.
        let now = Instant::now();
        let (frees_after, vllm) = (w.frees_after, w.vllm.clone());
        let held = c.memory(now, frees_after, &vllm);
        if held > 0 {
            let until = c.ended_at.unwrap_or(now) + frees_after;
            w.ghosts.push((c.gpus, held, until));
        }
        Ok(())
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        let w = lock(&self.world);
        let c = w
            .containers
            .get(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
        match c.files.get(path) {
            Some(bytes) if bytes.len() as u64 > limit => Err(EngineError::FileTooLarge {
                container: id.to_owned(),
                path: path.to_owned(),
                limit,
            }),
            found => Ok(found.cloned()),
        }
    }

    async fn stdout(&self, id: &str, limit: usize) -> Result<String, EngineError> {
        let w = lock(&self.world);
        let c = w
            .containers
            .get(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
        let out = &c.behaviour.stdout;
        let mut from = out.len().saturating_sub(limit);
        while !out.is_char_boundary(from) {
            from += 1;
        }
        Ok(out[from..].to_owned())
    }

    async fn logs(&self, id: &str, tail: Option<usize>) -> Result<String, EngineError> {
        let w = lock(&self.world);
        let c = w
            .containers
            .get(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
        Ok(tail_lines(&c.behaviour.stdout, tail))
    }

    fn log_stream(&self, id: &str, tail: Option<usize>, _follow: bool) -> LogStream {
        let w = lock(&self.world);
        let chunk = w
            .containers
            .get(id)
            .map(|c| tail_lines(&c.behaviour.stdout, tail).into_bytes())
            .ok_or_else(|| EngineError::NotFound(id.to_owned()));
        futures_util::stream::once(std::future::ready(chunk)).boxed()
    }
}

fn tail_lines(text: &str, tail: Option<usize>) -> String {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let skip = tail.map_or(0, |t| lines.len().saturating_sub(t));
    lines[skip..].concat()
}
