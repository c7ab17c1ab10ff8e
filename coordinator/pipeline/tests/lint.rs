//! Bad workflows are refused with the line and the rule; every problem is reported.

use nightshift_pipeline::{Diagnostic, Rule, load};

const HEAD: &str =
    "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  generateName: t-\nspec:\n";

/// Loads `HEAD + spec` and returns the diagnostics as `(line, rule, message)`.
fn refused(spec: &str) -> Vec<Diagnostic> {
    match load(&format!("{HEAD}{spec}")) {
        Ok(_) => panic!("accepted:\n{spec}"),
        Err(d) => d.0,
    }
}

fn has(diags: &[Diagnostic], line: usize, rule: Rule, words: &str) {
    assert!(
        diags
            .iter()
            .any(|d| d.line == line && d.rule == rule && d.message.contains(words)),
        "no {rule} at line {line} containing {words:?} in {diags:#?}"
    );
}

const ECHO: &str = "  - name: echo\n    inputs:\n      parameters:\n      - name: m\n    container:\n      image: busybox\n      args: [\"{{inputs.parameters.m}}\"]\n";

#[test]
fn a_cycle_of_tasks_names_the_circle() {
    let spec = format!(
        "  entrypoint: main\n  templates:\n  - name: main\n    dag:\n      tasks:\n\
         \x20     - {{name: A, template: echo, depends: C, arguments: {{parameters: [{{name: m, value: a}}]}}}}\n\
         \x20     - {{name: B, template: echo, depends: A, arguments: {{parameters: [{{name: m, value: b}}]}}}}\n\
         \x20     - {{name: C, template: echo, depends: B, arguments: {{parameters: [{{name: m, value: c}}]}}}}\n{ECHO}"
    );
    let d = refused(&spec);
    has(&d, 11, Rule::Cycle, "A -> C -> B -> A");
}

#[test]
fn unknown_template_and_task_and_entrypoint() {
    let spec = "  entrypoint: mian\n  templates:\n  - name: main\n    dag:\n      tasks:\n      - name: A\n        template: ecoh\n      - name: B\n        template: ecoh\n        depends: Z\n";
    let d = refused(spec);
    has(&d, 6, Rule::UnknownTemplate, "entrypoint mian");
    has(&d, 12, Rule::UnknownTemplate, "template ecoh");
    has(&d, 15, Rule::UnknownTask, "depends on Z");
}

#[test]
fn undefined_parameters_are_named() {
    let spec = "  entrypoint: main\n  arguments:\n    parameters:\n    - {name: msg, value: hi}\n  templates:\n  - name: main\n    container:\n      image: busybox\n      args: [\"{{workflow.parameters.mgs}}\", \"{{inputs.parameters.x}}\", \"{{item}}\"]\n";
    let d = refused(spec);
    has(&d, 14, Rule::UndefinedReference, "no parameter mgs");
    has(&d, 14, Rule::UndefinedReference, "no input parameter x");
    has(&d, 14, Rule::UndefinedReference, "withItems");
}

#[test]
fn outputs_of_steps_must_exist_and_come_earlier() {
    let spec = format!(
        "  entrypoint: main\n  templates:\n  - name: main\n    steps:\n    - - name: a\n        template: echo\n        arguments:\n          parameters: [{{name: m, value: \"{{{{steps.b.outputs.result}}}}\"}}]\n      - name: b\n        template: echo\n        arguments:\n          parameters: [{{name: m, value: \"{{{{steps.a.outputs.parameters.nope}}}}\"}}]\n{ECHO}"
    );
    let d = refused(&spec);
    has(
        &d,
        13,
        Rule::UndefinedReference,
        "b is not a step of an earlier group",
    );
    has(
        &d,
        17,
        Rule::UndefinedReference,
        "a is not a step of an earlier group",
    );
}

#[test]
fn missing_arguments_and_extra_ones() {
    let spec = format!(
        "  entrypoint: main\n  templates:\n  - name: main\n    steps:\n    - - name: a\n        template: echo\n      - name: b\n        template: echo\n        arguments:\n          parameters: [{{name: m, value: x}}, {{name: n, value: y}}]\n{ECHO}"
    );
    let d = refused(&spec);
    has(
        &d,
        10,
        Rule::MissingArgument,
        "without its input parameter m",
    );
    has(&d, 15, Rule::UndefinedReference, "passes parameter n");
}

#[test]
fn malformed_expressions() {
    let spec = format!(
        "  entrypoint: main\n  templates:\n  - name: main\n    dag:\n      tasks:\n      - name: A\n        template: echo\n        arguments: {{parameters: [{{name: m, value: x}}]}}\n        when: \"{{{{tasks.x.status}}}} ==\"\n      - name: B\n        template: echo\n        depends: \"A &\"\n        arguments: {{parameters: [{{name: m, value: x}}]}}\n{ECHO}"
    );
    let d = refused(&spec);
    has(&d, 17, Rule::MalformedExpression, "must be doubled");
    has(
        &d,
        14,
        Rule::MalformedExpression,
        "ends where a value is expected",
    );
    has(
        &d,
        14,
        Rule::UndefinedReference,
        "x is not a task this one depends on",
    );
}

#[test]
fn unsupported_and_unknown_fields_name_their_line() {
    let spec = "  entrypoint: main\n  volumes: []\n  templates:\n  - name: main\n    script:\n      image: python\n      source: print(1)\n  - name: other\n    container:\n      image: busybox\n      imagePulPolicy: Always\n";
    let d = refused(spec);
    has(&d, 7, Rule::UnsupportedFeature, "`volumes` in spec");
    has(
        &d,
        10,
        Rule::UnsupportedFeature,
        "`script` in template main: script templates are not supported",
    );
    has(
        &d,
        16,
        Rule::UnknownField,
        "`imagePulPolicy` is not a field",
    );
}

#[test]
fn recursion_without_a_when_is_a_cycle() {
    let spec = "  entrypoint: main\n  templates:\n  - name: main\n    steps:\n    - - name: again\n        template: main\n";
    has(&refused(spec), 8, Rule::Cycle, "main -> main");
    let guarded = format!(
        "{HEAD}  entrypoint: main\n  templates:\n  - name: main\n    steps:\n    - - name: again\n        template: main\n        when: \"{{{{workflow.status}} == Running\"\n"
    );
    assert!(load(&guarded).is_ok());
}

#[test]
fn gpus_and_nightshift_annotations_are_read() {
    let text = String::from(
        "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  name: sft\n  annotations:\n    nightshift.io/priority: \"5\"\n    nightshift.io/checkpoint-signal: SIGUSR1\nspec:\n  entrypoint: main\n  templates:\n  - name: main\n    metadata:\n      annotations:\n        nightshift.io/grace-period-seconds: \"120\"\n    container:\n      image: trainer:1\n      resources:\n        limits:\n          nvidia.com/gpu: 4\n",
    );
    let wf = load(&text).unwrap();
    let t = &wf.templates[0];
    let nightshift_pipeline::workflow::Body::Container(c) = &t.body else {
        panic!("not a container")
    };
    assert_eq!(c.gpus, 4);
    let extras = t.extras.over(&wf.extras);
    assert_eq!(
        (
            extras.priority,
            extras.checkpoint_signal.as_deref(),
            extras.grace_period_seconds
        ),
        (Some(5), Some("SIGUSR1"), Some(120))
    );
    let bad = text
        .replace("SIGUSR1", "SIGKILL")
        .replace("nightshift.io/priority", "nightshift.io/prio");
    let d = load(&bad).unwrap_err().0;
    has(
        &d,
        6,
        Rule::UnknownField,
        "unknown nightshift annotation nightshift.io/prio",
    );
    has(&d, 7, Rule::InvalidValue, "must be one of SIGTERM");
}

#[test]
fn yaml_syntax_errors_have_a_line() {
    let d = load("apiVersion: argoproj.io/v1alpha1\nkind: [Workflow\nspec: {}\n")
        .unwrap_err()
        .0;
    assert_eq!(d[0].rule, Rule::YamlSyntax);
    assert!(d[0].line >= 2, "{d:?}");
}

#[test]
fn names_people_read_refuse_characters_a_display_hides() {
    // Each name below is printed by `nightshift pipelines` and the web UI, or becomes a job's
    // name or output; a zero-width or bidi character would hide in it.
    let text = "apiVersion: argoproj.io/v1alpha1\nkind: Workflow\nmetadata:\n  \
                name: \"nightly\\u200b\"\n  annotations:\n    \
                nightshift.io/owner: \"nlp\\u2066\"\nspec:\n  entrypoint: main\n  \
                templates:\n  - name: main\n    steps:\n    - - name: \"tra\\u202ein\"\n        \
                template: \"echo\\u200d\"\n  - name: \"echo\\u200d\"\n    container:\n      \
                image: busybox\n    outputs:\n      parameters:\n      - name: \"lo\\u00adss\"\n        \
                valueFrom: {path: /out/loss}\n";
    let d = load(text).unwrap_err().0;
    has(
        &d,
        4,
        Rule::InvalidValue,
        "metadata.name: U+200B (zero width space) is not allowed",
    );
    has(
        &d,
        6,
        Rule::InvalidValue,
        "annotation nightshift.io/owner: U+2066 (left-to-right isolate) is not allowed",
    );
    has(
        &d,
        12,
        Rule::InvalidValue,
        "a step's name: U+202E (right-to-left override) is not allowed",
    );
    has(
        &d,
        14,
        Rule::InvalidValue,
        "a template's name: U+200D (zero width joiner) is not allowed",
    );
    has(
        &d,
        19,
        Rule::InvalidValue,
        "an output parameter's name: U+00AD (soft hyphen) is not allowed",
    );
    let clean = text
        .replace("\\u200b", "")
        .replace("\\u2066", "")
        .replace("\\u202e", "")
        .replace("\\u200d", "")
        .replace("\\u00ad", "");
    assert!(load(&clean).is_ok(), "{clean}");
}

#[test]
fn a_steps_gpu_variables_are_the_agents_alone() {
    let spec = "  entrypoint: main\n  templates:\n  - name: main\n    container:\n      \
                image: busybox\n      env:\n      - {name: HF_HOME, value: /data}\n      \
                - {name: NVIDIA_VISIBLE_DEVICES, value: all}\n      \
                - {name: CUDA_VISIBLE_DEVICES, value: \"0,1,2,3\"}\n";
    let d = refused(spec);
    has(
        &d,
        13,
        Rule::InvalidValue,
        "env: NVIDIA_VISIBLE_DEVICES is the agent's to set",
    );
    has(
        &d,
        14,
        Rule::InvalidValue,
        "env: CUDA_VISIBLE_DEVICES is the agent's to set",
    );
    assert_eq!(d.len(), 2, "{d:#?}");
}
