//! The Kubernetes example against the API's own types (k8s-openapi): every
//! document parses as an object of its kind and back without losing a
//! field, and it grants and passes what `--scaler kubernetes` needs. No API
//! server runs here: nothing is applied.

use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{Service, ServiceAccount},
    rbac::v1::{Role, RoleBinding},
};
use serde_json::Value;
use std::path::Path;

/// Parses `doc` as a `T` and back: equal to the document when nothing in
/// it is unknown to the API (a misspelt field would be dropped).
fn typed<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) -> T {
    let t: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{e}: {doc}"));
    let back = serde_json::to_value(&t).unwrap();
    assert_eq!(&back, doc, "a field the API does not know was dropped");
    t
}

#[test]
fn the_kubernetes_example_is_made_of_valid_api_objects_that_run_the_kubernetes_scaler() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/kubernetes/job.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let docs: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
    let mut kinds = Vec::new();
    let mut coordinator = None;
    let mut role = None;
    for doc in &docs {
        let kind = doc["kind"].as_str().unwrap().to_string();
        match kind.as_str() {
            "ServiceAccount" => drop(typed::<ServiceAccount>(doc)),
            "RoleBinding" => drop(typed::<RoleBinding>(doc)),
            "Service" => drop(typed::<Service>(doc)),
            "Role" => role = Some(typed::<Role>(doc)),
            "Deployment" => {
                let d = typed::<Deployment>(doc);
                if d.metadata.name.as_deref() == Some("edl-mnist") {
                    coordinator = Some(d);
                }
            }
            other => panic!("an object of kind {other} in {}", path.display()),
        }
        kinds.push(kind);
    }
    assert_eq!(kinds.len(), 6, "{kinds:?}");
    // The coordinators may make, delete and watch Pods.
    let rules = role.unwrap().rules.unwrap();
    let pods =
        rules.iter().find(|r| r.resources.as_ref().is_some_and(|r| r.contains(&"pods".to_string()))).unwrap();
    for verb in ["create", "delete", "get", "list"] {
        assert!(pods.verbs.contains(&verb.to_string()), "{verb}");
    }
    // And read an ended worker's log before its Pod is deleted.
    let logs = rules
        .iter()
        .find(|r| r.resources.as_ref().is_some_and(|r| r.contains(&"pods/log".to_string())))
        .expect("a rule for pods/log");
    assert!(logs.verbs.contains(&"get".to_string()), "{logs:?}");
    // With --relay, the Service the workers find their node's relay through.
    let services = rules
        .iter()
        .find(|r| r.resources.as_ref().is_some_and(|r| r.contains(&"services".to_string())))
        .expect("a rule for services");
    for verb in ["create", "delete"] {
        assert!(services.verbs.contains(&verb.to_string()), "{verb}: {services:?}");
    }
    // Two coordinators, one a standby at any time, running the scaler with
    // the flags this edl-runtime takes.
    let d = coordinator.unwrap();
    let spec = d.spec.unwrap();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some("edl-coordinator"));
    let c = &pod.containers[0];
    let line = c.args.as_ref().unwrap().join(" ");
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(words[0], "exec");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_edl-runtime"))
        .args(words[2..].iter().map(|w| w.trim_matches('"')))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "the example's flags: {}", String::from_utf8_lossy(&out.stderr));
    for flag in ["--standby", "--scaler kubernetes", "--kube-secret edl-mnist", "--kube-owner controller"] {
        assert!(line.contains(flag), "{flag} in {line}");
    }
    // The secret is a mounted Secret, on no command line.
    assert!(line.contains("--secret-file /var/run/edl/secret"), "{line}");
    let env: Vec<&str> = c.env.as_ref().unwrap().iter().map(|e| e.name.as_str()).collect();
    assert!(env.contains(&"POD_NAME") && env.contains(&"POD_IP"), "{env:?}");
}
