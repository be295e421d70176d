//! The manifests in `deploy/kubernetes/` hold to the configuration they
//! ship: `floodgate --check` accepts the ConfigMap's file, the probes and
//! the scrape point at the ports and paths that file opens, the grace
//! period covers the drain, and the pod runs as the image's user with a
//! read-only root. A ConfigMap update (kubelet's symlink swap) is reloaded.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_yaml_ng::Value;
use support::{Floodgate, TestClient};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes");

fn manifest(file: &str) -> Value {
    let path = format!("{DIR}/{file}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn text<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value:?}"))
}

fn number(value: &Value, what: &str) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("{what} is not a whole number: {value:?}"))
}

/// The ConfigMap's `floodgate.toml`, written where kubelet would put it.
fn shipped_config(dir: &Path) -> PathBuf {
    let map = manifest("configmap.yaml");
    assert_eq!(map["kind"], "ConfigMap");
    let path = dir.join("floodgate.toml");
    std::fs::write(
        &path,
        text(&map["data"]["floodgate.toml"], "data.floodgate.toml"),
    )
    .expect("write the ConfigMap's file");
    path
}

/// The container's port named `name` (a probe's `port` may be a name or a
/// number).
fn container_port(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = text(port, "port");
    let ports = container["ports"].as_sequence().expect("container ports");
    ports
        .iter()
        .find(|p| p["name"] == name)
        .map(|p| number(&p["containerPort"], "containerPort"))
        .unwrap_or_else(|| panic!("no container port named {name}"))
}

#[test]
fn the_kustomization_names_every_manifest() {
    let kustomization = manifest("kustomization.yaml");
    let mut listed: Vec<String> = kustomization["resources"]
        .as_sequence()
        .expect("resources")
        .iter()
        .map(|r| text(r, "resource").to_owned())
        .collect();
    listed.sort();
    let mut present: Vec<String> = std::fs::read_dir(DIR)
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml") && name != "kustomization.yaml")
        .collect();
    present.sort();
    assert_eq!(listed, present);
}

/// `floodgate --check` accepts the ConfigMap's file.
fn floodgate_check_accepts(file: &Path) {
    let check = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["--check", "--config"])
        .arg(file)
        .output()
        .expect("run --check");
    assert!(
        check.status.success(),
        "floodgate --check refuses the ConfigMap's file: {}",
        String::from_utf8_lossy(&check.stderr)
    );
}

/// The file floodgate reads is the ConfigMap's, mounted as a directory.
fn the_config_file_is_the_configmaps_mount(spec: &Value, container: &Value) {
    let env = container["env"].as_sequence().expect("env");
    let config_path = env
        .iter()
        .find(|e| e["name"] == "FLOODGATE_CONFIG")
        .map(|e| text(&e["value"], "FLOODGATE_CONFIG"))
        .expect("FLOODGATE_CONFIG");
    let (mount_dir, file_name) = config_path.rsplit_once('/').expect("a path");
    assert_eq!(file_name, "floodgate.toml");
    let mount = container["volumeMounts"]
        .as_sequence()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["mountPath"] == mount_dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {mount_dir}"));
    assert!(
        mount.get("subPath").is_none(),
        "a subPath mount never sees a ConfigMap update"
    );
    let volume = spec["volumes"]
        .as_sequence()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    assert_eq!(
        volume["configMap"]["name"],
        manifest("configmap.yaml")["metadata"]["name"]
    );
}

/// Ports, probes and the scrape follow the file.
fn ports_probes_and_scrape_follow_the_file(
    pod: &Value,
    container: &Value,
    listen_port: u16,
    admin_port: u16,
) {
    assert_eq!(
        container_port(container, &Value::from("http")),
        u64::from(listen_port)
    );
    let admin_port = u64::from(admin_port);
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(
            container_port(container, &get["port"]),
            admin_port,
            "{probe}"
        );
    }
    let scrape = &pod["metadata"]["annotations"];
    assert_eq!(scrape["prometheus.io/scrape"], "true");
    assert_eq!(
        text(&scrape["prometheus.io/port"], "prometheus.io/port"),
        admin_port.to_string()
    );
    assert_eq!(scrape["prometheus.io/path"], "/metrics");
}

/// The kubelet's SIGKILL comes after the drain and the grace.
fn the_grace_period_covers_the_drain(spec: &Value, needed: Duration) {
    let grace = number(
        &spec["terminationGracePeriodSeconds"],
        "terminationGracePeriodSeconds",
    );
    assert!(
        Duration::from_secs(grace) > needed,
        "terminationGracePeriodSeconds {grace} does not cover drain_delay + shutdown_grace = {needed:?}"
    );
}

/// The image's user, nothing to escalate to, a read-only root, and
/// resources the scheduler can place.
fn the_pod_runs_as_the_images_user(spec: &Value, container: &Value) {
    let dockerfile = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile"))
        .expect("Dockerfile");
    let user = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the image's USER");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    assert_eq!(spec["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        number(&spec["securityContext"]["runAsUser"], "runAsUser").to_string(),
        uid
    );
    assert_eq!(
        number(&spec["securityContext"]["runAsGroup"], "runAsGroup").to_string(),
        gid
    );
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    let requests = &container["resources"]["requests"];
    assert!(requests.get("cpu").is_some() && requests.get("memory").is_some());
}

/// The Service reaches the proxy port, never the admin port.
fn the_service_reaches_the_proxy_port_only(labels: &Value, container: &Value, listen_port: u16) {
    let service = manifest("service.yaml");
    assert_eq!(service["kind"], "Service");
    for (key, value) in service["spec"]["selector"].as_mapping().expect("selector") {
        assert_eq!(&labels[key], value, "the Service selects the pods");
    }
    for port in service["spec"]["ports"].as_sequence().expect("ports") {
        assert_eq!(
            container_port(container, &port["targetPort"]),
            u64::from(listen_port),
            "the Service exposes {port:?}"
        );
    }
}

/// A drain keeps a replica.
fn a_drain_keeps_a_replica(deployment: &Value, labels: &Value) {
    let budget = manifest("pdb.yaml");
    assert_eq!(budget["kind"], "PodDisruptionBudget");
    assert_eq!(&budget["spec"]["selector"]["matchLabels"], labels);
    let replicas = number(&deployment["spec"]["replicas"], "replicas");
    let min_available = number(&budget["spec"]["minAvailable"], "minAvailable");
    assert!(min_available >= 1 && min_available < replicas);
}

#[test]
fn the_manifests_hold_to_the_configuration_they_ship() {
    let dir = support::temp_dir("kubernetes");
    let file = shipped_config(&dir);
    floodgate_check_accepts(&file);
    let config = floodgate::config::load(&file).unwrap_or_else(|e| panic!("{e}"));
    let server = &config.server;
    let admin = server
        .admin_listen
        .expect("the ConfigMap's file has an admin listener for the probes");
    assert!(
        server.listen.ip().is_unspecified() && admin.ip().is_unspecified(),
        "the pod's listeners must be reachable from outside the container: {} and {admin}",
        server.listen
    );

    let deployment = manifest("deployment.yaml");
    assert_eq!(deployment["kind"], "Deployment");
    let pod = &deployment["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(&deployment["spec"]["selector"]["matchLabels"], labels);
    let spec = &pod["spec"];
    let containers = spec["containers"].as_sequence().expect("containers");
    assert_eq!(containers.len(), 1);
    let container = &containers[0];

    the_config_file_is_the_configmaps_mount(spec, container);
    ports_probes_and_scrape_follow_the_file(pod, container, server.listen.port(), admin.port());
    the_grace_period_covers_the_drain(spec, server.drain_delay + server.shutdown_grace);
    the_pod_runs_as_the_images_user(spec, container);
    the_service_reaches_the_proxy_port_only(labels, container, server.listen.port());
    a_drain_keeps_a_replica(&deployment, labels);
}

/// Writes `text` the way kubelet updates a mounted ConfigMap: a new
/// timestamped directory, `..data` swapped to it by a rename, the old one
/// removed; `floodgate.toml` is a symlink through `..data` throughout.
fn kubelet_writes(dir: &Path, generation: u32, text: &str) {
    let data = dir.join(format!("..2026_12_02_00_00_0{generation}.000000001"));
    std::fs::create_dir(&data).expect("timestamped directory");
    std::fs::write(data.join("floodgate.toml"), text).expect("the file");
    let swap = dir.join("..data_tmp");
    std::os::unix::fs::symlink(data.file_name().expect("name"), &swap).expect("..data_tmp");
    let previous = std::fs::read_link(dir.join("..data")).ok();
    std::fs::rename(&swap, dir.join("..data")).expect("swap ..data");
    if let Some(previous) = previous {
        std::fs::remove_dir_all(dir.join(previous)).expect("remove the old directory");
    }
    let link = dir.join("floodgate.toml");
    if std::fs::symlink_metadata(&link).is_err() {
        std::os::unix::fs::symlink("..data/floodgate.toml", &link).expect("floodgate.toml");
    }
}

fn answering(body: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[[routes]]\nname = \"hello\"\n\
         respond = {{ status = 200, body = \"{body}\" }}\n"
    )
}

#[tokio::test]
async fn a_configmap_update_is_reloaded() {
    let dir = support::temp_dir("configmap");
    kubelet_writes(&dir, 1, &answering("first"));
    let gate = Floodgate::start_file(&dir.join("floodgate.toml")).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/"), &[]).await.text(), "first");
    kubelet_writes(&dir, 2, &answering("second"));
    // The file is compared once a second; on a loaded machine give it many.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body = client.get(&gate.url("/"), &[]).await.text();
        if body == "second" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the swapped ConfigMap was not reloaded: still {body:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
