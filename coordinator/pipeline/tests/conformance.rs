//! The Argo Workflows conformance set (`shared/conformance/argo-workflows/`): every manifest
//! either loads or is refused naming the unsupported feature, exactly as listed here and in
//! docs/PIPELINES.md.

use std::path::PathBuf;

use nightshift_pipeline::Rule;

/// `None`: the manifest loads. `Some((line, rule, words))`: it is refused, first at `line`
/// with `rule`, and the message contains `words`.
type Verdict = Option<(usize, Rule, &'static str)>;

const EXPECTED: &[(&str, Verdict)] = &[
    ("arguments-parameters.yaml", None),
    ("artifact-passing.yaml", None),
    (
        "conditionals.yaml",
        Some((32, Rule::UnsupportedFeature, "expr-lang expressions")),
    ),
    ("continue-on-fail.yaml", None),
    ("dag-diamond-dependencies.yaml", None),
    ("dag-diamond-steps.yaml", None),
    ("dag-diamond.yaml", None),
    ("dag-enhanced-depends.yaml", None),
    ("dag-multiroot.yaml", None),
    ("dag-nested.yaml", None),
    ("dag-task-level-timeout.yaml", None),
    ("exit-handler-dag-level.yaml", None),
    ("exit-handlers.yaml", None),
    ("global-parameters.yaml", None),
    ("hello-world.yaml", None),
    ("loops-dag.yaml", None),
    (
        "loops-param-argument.yaml",
        Some((
            44,
            Rule::UnknownField,
            "`annotations` is not a field of template cat-os-release",
        )),
    ),
    ("loops.yaml", None),
    ("nested-workflow.yaml", None),
    ("output-parameter.yaml", None),
    ("parameter-aggregation-dag.yaml", None),
    ("retry-backoff.yaml", None),
    ("retry-on-error.yaml", None),
    ("retry-with-steps.yaml", None),
    ("steps.yaml", None),
    ("timeouts-step.yaml", None),
    (
        "timeouts-workflow.yaml",
        Some((
            36,
            Rule::UnsupportedFeature,
            "`nodeSelector` in template unschedulable",
        )),
    ),
];

/// `$NIGHTSHIFT_CONFORMANCE_DIR`, else the first `shared/conformance/argo-workflows` found
/// walking up from this crate (the shared folder sits beside the checkouts).
fn conformance_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("NIGHTSHIFT_CONFORMANCE_DIR") {
        return dir.into();
    }
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .map(|a| a.join("shared/conformance/argo-workflows"))
        .find(|p| p.is_dir())
        .unwrap_or_else(|| {
            panic!(
                "no shared/conformance/argo-workflows above {}; set NIGHTSHIFT_CONFORMANCE_DIR",
                here.display()
            )
        })
}

#[test]
fn every_conformance_manifest_gets_its_expected_verdict() {
    let dir = conformance_dir();
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    files.sort();
    let listed: Vec<&str> = EXPECTED.iter().map(|(f, _)| *f).collect();
    assert_eq!(files, listed, "the conformance set and this table differ");

    let mut wrong = Vec::new();
    for (file, expected) in EXPECTED {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let got = nightshift_pipeline::load(&text);
        let ok = match (&got, expected) {
            (Ok(_), None) => true,
            (Err(diags), Some((line, rule, words))) => diags
                .0
                .first()
                .is_some_and(|d| d.line == *line && d.rule == *rule && d.message.contains(words)),
            _ => false,
        };
        if !ok {
            wrong.push(format!("{file}: expected {expected:?}, got {got:#?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
