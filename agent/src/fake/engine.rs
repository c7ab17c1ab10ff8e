//! The fake container engine: the [`Engine`] port over the node's host model.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use nightshift_hostmodel::{Image, Launch, RunError};

use super::{Start, World, gpu_indices, lock, until};
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

fn stopped() -> EngineError {
    EngineError::Other(
        "Cannot connect to the Docker daemon (the fake engine is stopped)".to_owned(),
    )
}

fn info(image: Image, in_use: bool) -> ImageInfo {
    ImageInfo {
        id: image.id,
        repo_digests: image.repo_digests,
        created: image.created,
        in_use,
    }
}

impl Engine for FakeEngine {
    async fn version(&self) -> Result<String, EngineError> {
        Ok("Fake 1.0 (in memory)".to_owned())
    }

    async fn list(&self, labels: &BTreeMap<String, String>) -> Result<Vec<Container>, EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        if !w.host.engine_answers() {
            return Err(stopped());
        }
        Ok(w.host
            .containers()
            .into_iter()
            .filter(|c| labels.iter().all(|(k, v)| c.labels.get(k) == Some(v)))
            .collect())
    }

    async fn image(&self, image: &str) -> Result<Option<ImageInfo>, EngineError> {
        let w = lock(&self.world);
        Ok(w.host.images.get(image).map(|i| info(i, false)))
    }

    async fn pull(
        &self,
        image: &str,
        auth: Option<&RegistryAuth>,
    ) -> Result<ImageInfo, EngineError> {
        let returns = {
            let mut w = lock(&self.world);
            let now = w.settle();
            w.engine_calls.push(EngineCall::Pull {
                image: image.to_owned(),
                user: auth.map(|a| a.username.clone()),
            });
            let auth = auth.map(|a| (a.username.as_str(), a.password.as_str()));
            w.host.pull(image, auth, now)
        };
        until(&self.world, returns).await;
        let mut w = lock(&self.world);
        w.settle();
        // Two pulls of one image are one pull: the second finds it done.
        let result = w.host.take_pull(image).unwrap_or_else(|| {
            w.host
                .images
                .get(image)
                .ok_or_else(|| "manifest unknown".to_owned())
        });
        result
            .map(|i| info(i, false))
            .map_err(|reason| EngineError::PullFailed {
                image: image.to_owned(),
                registry: registry_of(image),
                reason,
            })
    }

    async fn images(&self) -> Result<Vec<ImageInfo>, EngineError> {
        let w = lock(&self.world);
        Ok(w.host
            .images
            .list()
            .into_iter()
            .map(|i| {
                let in_use = w.host.image_in_use(&i.id);
                info(i, in_use)
            })
            .collect())
    }

    async fn remove_image(&self, id: &str) -> Result<(), EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        if w.host.remove_image(id) {
            w.engine_calls
                .push(EngineCall::RemoveImage { id: id.to_owned() });
        }
        Ok(())
    }

    async fn data_root(&self) -> Result<Option<std::path::PathBuf>, EngineError> {
        Ok(Some("/var/lib/docker".into()))
    }

    async fn inspect(&self, id: &str) -> Result<Container, EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        w.host
            .inspect(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))
    }

    async fn run(&self, spec: &ContainerSpec) -> Result<String, EngineError> {
        let mut w = lock(&self.world);
        let now = w.settle();
        w.engine_calls.push(EngineCall::Run {
            name: spec.name.clone(),
            image: spec.image.clone(),
        });
        let gpus = gpu_indices(&spec.gpus);
        // As Docker's adapter: a running container of that name is the one.
        let existing = w
            .host
            .containers()
            .into_iter()
            .any(|c| c.name == spec.name && c.state == ContainerState::Running);
        let held_bytes = gpus.iter().map(|g| w.host.gpu_used(*g)).max().unwrap_or(0);
        let launch = Launch {
            name: spec.name.clone(),
            image: spec.image.clone(),
            labels: spec.labels.clone(),
            gpus: gpus.clone(),
            files: spec.files.clone(),
            publish: spec.publish.as_ref().map(|p| p.host_port),
        };
        let World {
            host, behaviours, ..
        } = &mut *w;
        let id = host.run(launch, now, behaviours).map_err(|e| match e {
            RunError::Missing => EngineError::ImageMissing(spec.image.clone()),
            RunError::Refused(reason) => EngineError::Refused {
                container: spec.name.clone(),
                reason,
            },
            RunError::EngineDown => stopped(),
        })?;
        if existing {
            return Ok(id);
        }
        let image = host.images.tag_of(&spec.image).to_owned();
        let behaviour = behaviours.0.get(&image).cloned().unwrap_or_default();
        for (path, content) in &behaviour.files {
            host.write_file(&id, path, content);
        }
        host.print(&id, &behaviour.stdout);
        w.starts.push(Start {
            id: id.clone(),
            labels: spec.labels.clone(),
            gpus,
            held_bytes,
        });
        Ok(id)
    }

    async fn signal(&self, id: &str, signal: &str) -> Result<(), EngineError> {
        let mut w = lock(&self.world);
        let now = w.settle();
        w.engine_calls.push(EngineCall::Signal {
            id: id.to_owned(),
            signal: signal.to_owned(),
        });
        let World {
            host, behaviours, ..
        } = &mut *w;
        if !host.signal(id, now, behaviours) {
            return Err(EngineError::NotFound(id.to_owned()));
        }
        Ok(())
    }

    async fn stop(&self, id: &str, grace: Duration) -> Result<(), EngineError> {
        let exits = {
            let mut w = lock(&self.world);
            let now = w.settle();
            w.engine_calls.push(EngineCall::Stop {
                id: id.to_owned(),
                grace,
            });
            let running = w
                .host
                .inspect(id)
                .ok_or_else(|| EngineError::NotFound(id.to_owned()))?
                .state
                == ContainerState::Running;
            if !running {
                return Ok(());
            }
            let World {
                host, behaviours, ..
            } = &mut *w;
            host.stop(id, grace, now, behaviours)
        };
        until(&self.world, Some(exits)).await;
        lock(&self.world).settle();
        Ok(())
    }

    async fn remove(&self, id: &str) -> Result<(), EngineError> {
        let mut w = lock(&self.world);
        w.settle();
        w.engine_calls
            .push(EngineCall::Remove { id: id.to_owned() });
        w.host.remove(id);
        Ok(())
    }

    async fn read_file(
        &self,
        id: &str,
        path: &str,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        let w = lock(&self.world);
        match w.host.read_file(id, path) {
            None => Err(EngineError::NotFound(id.to_owned())),
            Some(Some(bytes)) if bytes.len() as u64 > limit => Err(EngineError::FileTooLarge {
                container: id.to_owned(),
                path: path.to_owned(),
                limit,
            }),
            Some(found) => Ok(found.map(<[u8]>::to_vec)),
        }
    }

    async fn stdout(&self, id: &str, limit: usize) -> Result<String, EngineError> {
        let w = lock(&self.world);
        let out = w
            .host
            .stdout(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
        let mut from = out.len().saturating_sub(limit);
        while !out.is_char_boundary(from) {
            from += 1;
        }
        Ok(out[from..].to_owned())
    }

    async fn logs(&self, id: &str, tail: Option<usize>) -> Result<String, EngineError> {
        let w = lock(&self.world);
        let out = w
            .host
            .stdout(id)
            .ok_or_else(|| EngineError::NotFound(id.to_owned()))?;
        Ok(tail_lines(out, tail))
    }

    fn log_stream(&self, id: &str, tail: Option<usize>, _follow: bool) -> LogStream {
        let w = lock(&self.world);
        let chunk = w
            .host
            .stdout(id)
            .map(|out| tail_lines(out, tail).into_bytes())
            .ok_or_else(|| EngineError::NotFound(id.to_owned()));
        futures_util::stream::once(std::future::ready(chunk)).boxed()
    }
}

fn tail_lines(text: &str, tail: Option<usize>) -> String {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let skip = tail.map_or(0, |t| lines.len().saturating_sub(t));
    lines[skip..].concat()
}
