//! The Argo fields nightshift knows and refuses, each with what to do instead: the text of
//! every `unsupported-feature` finding.

/// Argo fields nightshift knows and refuses, with what to do instead.
pub(super) const UNSUPPORTED_SPEC: &[(&str, &str)] = &[
    (
        "volumes",
        "volumes are Kubernetes objects; pass small files as artifacts, larger data through storage the container reaches itself, its location a parameter",
    ),
    (
        "volumeClaimTemplates",
        "volumes are Kubernetes objects; pass small files as artifacts, larger data through storage the container reaches itself, its location a parameter",
    ),
    (
        "nodeSelector",
        "nightshift places steps on lent GPUs itself; node selection is not supported",
    ),
    (
        "affinity",
        "nightshift places steps on lent GPUs itself; affinity is not supported",
    ),
    (
        "tolerations",
        "nightshift places steps on lent GPUs itself; tolerations are not supported",
    ),
    (
        "serviceAccountName",
        "there is no Kubernetes service account outside Kubernetes",
    ),
    (
        "imagePullSecrets",
        "registry credentials are the agent's ([registry] auth_file in agent.toml), not a workflow's",
    ),
    ("securityContext", "security contexts are not supported"),
    ("hostNetwork", "host networking is not supported"),
    ("podGC", "pods do not exist outside Kubernetes"),
    ("podMetadata", "pods do not exist outside Kubernetes"),
    ("podSpecPatch", "pods do not exist outside Kubernetes"),
    ("ttlStrategy", "runs are kept in the coordinator's store"),
    (
        "artifactRepositoryRef",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "artifactGC",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "workflowTemplateRef",
        "workflow templates are not supported; submit the whole workflow",
    ),
    ("templateDefaults", "template defaults are not supported"),
    ("hooks", "lifecycle hooks are not supported; use onExit"),
    (
        "synchronization",
        "semaphores and mutexes are not supported",
    ),
    (
        "metrics",
        "Prometheus metrics of workflows are not supported",
    ),
    ("priority", "use the nightshift.io/priority annotation"),
    (
        "podPriorityClassName",
        "use the nightshift.io/priority annotation",
    ),
    ("suspend", "suspending a workflow is not supported"),
    ("shutdown", "use `nightshift cancel`"),
    ("executor", "executors are a Kubernetes concept"),
    ("retryStrategy", "put retryStrategy on the templates"),
    ("dnsPolicy", "DNS policy is not supported"),
    ("dnsConfig", "DNS policy is not supported"),
    ("archiveLogs", "logs are kept by the agents"),
];

pub(super) const UNSUPPORTED_TEMPLATE: &[(&str, &str)] = &[
    (
        "script",
        "script templates are not supported; use a container with command [sh, -c] (or [python, -c]) and the source in args",
    ),
    (
        "resource",
        "Kubernetes resource templates do not exist outside Kubernetes",
    ),
    ("suspend", "suspend templates are not supported"),
    ("data", "data templates are not supported"),
    ("http", "HTTP templates are not supported"),
    ("plugin", "plugin templates are not supported"),
    (
        "containerSet",
        "container sets are not supported; use steps",
    ),
    (
        "nodeSelector",
        "nightshift places steps on lent GPUs itself; node selection is not supported",
    ),
    (
        "affinity",
        "nightshift places steps on lent GPUs itself; affinity is not supported",
    ),
    (
        "tolerations",
        "nightshift places steps on lent GPUs itself; tolerations are not supported",
    ),
    (
        "volumes",
        "volumes are Kubernetes objects; pass files as artifacts",
    ),
    ("sidecars", "sidecars are not supported"),
    ("initContainers", "init containers are not supported"),
    ("daemon", "daemon steps are not supported"),
    (
        "synchronization",
        "semaphores and mutexes are not supported",
    ),
    ("memoize", "memoization is not supported"),
    ("podSpecPatch", "pods do not exist outside Kubernetes"),
    (
        "archiveLocation",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "priority",
        "use the nightshift.io/priority annotation on the template's metadata",
    ),
    (
        "priorityClassName",
        "use the nightshift.io/priority annotation on the template's metadata",
    ),
    (
        "serviceAccountName",
        "there is no Kubernetes service account outside Kubernetes",
    ),
    (
        "automountServiceAccountToken",
        "there is no Kubernetes service account outside Kubernetes",
    ),
    ("securityContext", "security contexts are not supported"),
    ("hostAliases", "host aliases are not supported"),
    (
        "metrics",
        "Prometheus metrics of workflows are not supported",
    ),
    ("executor", "executors are a Kubernetes concept"),
    ("schedulerName", "nightshift is the scheduler"),
];

pub(super) const UNSUPPORTED_STEP: &[(&str, &str)] = &[
    ("hooks", "lifecycle hooks are not supported; use onExit"),
    (
        "withSequence",
        "withSequence is not supported; use withItems",
    ),
    (
        "inline",
        "inline templates are not supported; name the template",
    ),
    (
        "templateRef",
        "workflow templates are not supported; put the template in this workflow",
    ),
];

pub(super) const UNSUPPORTED_CONTAINER: &[(&str, &str)] = &[
    (
        "volumeMounts",
        "volumes are not supported; pass files as artifacts",
    ),
    (
        "workingDir",
        "the image's working directory is used; cd in the command",
    ),
    ("ports", "step containers publish no ports"),
    ("securityContext", "security contexts are not supported"),
    (
        "envFrom",
        "config maps and secrets are Kubernetes objects; use env",
    ),
    ("livenessProbe", "probes are not supported"),
    ("readinessProbe", "probes are not supported"),
    ("startupProbe", "probes are not supported"),
    ("lifecycle", "container lifecycle hooks are not supported"),
    ("stdin", "step containers have no standard input"),
    ("tty", "step containers have no terminal"),
];

pub(super) const UNSUPPORTED_ARTIFACT: &[(&str, &str)] = &[
    (
        "s3",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each), not S3",
    ),
    (
        "gcs",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each), not GCS",
    ),
    (
        "git",
        "git artifacts are not supported; clone in the command",
    ),
    (
        "http",
        "HTTP artifacts are not supported; download in the command",
    ),
    (
        "artifactory",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "hdfs",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "oss",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "azure",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "raw",
        "raw artifacts are not supported; write the file in the command",
    ),
    (
        "archive",
        "artifacts pass as plain files (at most 64 KiB), never archived",
    ),
    ("optional", "optional artifacts are not supported"),
    ("mode", "artifact file modes are not supported"),
    ("globalName", "global artifacts are not supported"),
    (
        "recurseMode",
        "artifact directories are not supported; an artifact is one file of at most 64 KiB",
    ),
    ("subPath", "artifact sub-paths are not supported"),
    (
        "artifactGC",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
    (
        "deleted",
        "artifacts pass between steps through the coordinator (one file of at most 64 KiB each); there is no artifact repository",
    ),
];
