//! The local images that stand in for those Argo's examples name (`busybox`, `alpine:3.23`,
//! `alpine:3.7`, `argoproj/argosay:v1`/`v2`), run on the real Docker engine the way a
//! workflow step would run them: command and args replacing the entrypoint.

use std::process::Command;

/// Runs `image` with `entrypoint` and `args`; returns (exit code, stdout).
fn run(image: &str, entrypoint: Option<&str>, args: &[&str]) -> (i32, String) {
    let mut cmd = Command::new("docker");
    cmd.args(["run", "--rm", "--network", "none"]);
    if let Some(e) = entrypoint {
        cmd.args(["--entrypoint", e]);
    }
    cmd.arg(image).args(args);
    let out = cmd.output().expect("docker runs");
    assert!(
        out.status.code().is_some(),
        "docker run {image} was killed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

fn require(image: &str) {
    let ok = Command::new("docker")
        .args(["image", "inspect", image])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "image {image} is missing: run tests/images/build.sh (tests/run.sh does)"
    );
}

#[test]
fn busybox_and_alpine_run_the_examples_shell_commands_with_a_writable_tmp() {
    for image in ["busybox", "busybox:latest", "alpine:3.23", "alpine:3.7"] {
        require(image);
        // artifact-passing and parameter-aggregation-dag, in miniature.
        let script = "echo hello world | tee /tmp/hello_world.txt >/dev/null && \
                      cat /tmp/hello_world.txt && echo $((4%2)) $((3/2)) && stat -c %a /tmp";
        let (code, out) = run(image, Some("sh"), &["-c", script]);
        assert_eq!(
            (code, out.as_str()),
            (0, "hello world\n0 1\n1777\n"),
            "{image}"
        );
        let (code, out) = run(image, Some("echo"), &["A"]);
        assert_eq!((code, out.as_str()), (0, "A\n"), "{image}");
        let (code, _) = run(
            image,
            Some("sh"),
            &["-c", "echo intentional failure; exit 1"],
        );
        assert_eq!(code, 1, "{image}");
    }
}

#[test]
fn argosay_speaks_v1_and_v2() {
    for image in ["argoproj/argosay:v1", "argoproj/argosay:v2"] {
        require(image);
        let (code, out) = run(image, None, &["echo", "hello"]);
        assert_eq!((code, out.as_str()), (0, "hello\n"), "{image}");
        let (code, out) = run(image, None, &[]);
        assert_eq!((code, out.as_str()), (0, "hello argo\n"), "{image}");
        let (code, _) = run(image, None, &["exit", "3"]);
        assert_eq!(code, 3, "{image}");
        // conditionals.yaml: `sh -c "cowsay hello"`.
        let (code, out) = run(image, Some("sh"), &["-c", "cowsay hello"]);
        assert_eq!(code, 0, "{image}");
        assert!(out.contains("< hello >") && out.contains("(oo)"), "{out}");
        // timeouts-step.yaml: `bash -c "echo 123; ..."`.
        let (code, out) = run(image, Some("bash"), &["-c", "echo 123; sleep 0"]);
        assert_eq!((code, out.as_str()), (0, "123\n"), "{image}");
        let (code, out) = run(
            image,
            Some("sh"),
            &[
                "-c",
                "argosay echo hi /tmp/x && argosay assert_contains /tmp/x hi && cat /tmp/x",
            ],
        );
        assert_eq!((code, out.as_str()), (0, "hi"), "{image}");
    }
}
