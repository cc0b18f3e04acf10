"""Every rendered object validates: core kinds (and the pod templates inside the Ray resources) with
kubernetes-validate in strict mode for one stated Kubernetes version; RayService, RayJob, PodMonitor and
PrometheusRule against the openAPIV3Schema of their published CRDs in ../shared/crds."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from tests.k8s.chart import CI_VALUES, CRDS_DIR, KUBERNETES_VERSION, Obj, load_values, one, pod_templates, render
from tests.k8s.crd_schema import crd_schemas, schema_errors

SETUPS = ["default", *CI_VALUES]
CUSTOM_GROUPS = ("ray.io/", "monitoring.coreos.com/")
needs_crds = pytest.mark.skipif(not CRDS_DIR.is_dir(), reason=f"the published CRDs are not here ({CRDS_DIR} is absent)")


def _is_custom(obj: Obj) -> bool:
    return obj["apiVersion"].startswith(CUSTOM_GROUPS)


def _validate_core(obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(str(p) for p in e.path)
        raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {where}: {e.message}") from None


@pytest.mark.parametrize("setup", SETUPS)
def test_core_objects_validate(setup: str) -> None:
    for obj in render(load_values(setup)):
        if not _is_custom(obj):
            _validate_core(obj)


@pytest.mark.parametrize("setup", SETUPS)
def test_pod_templates_validate_as_core_pod_templates(setup: str) -> None:
    """The CRDs embed a copy of the pod spec schema; the Kubernetes release's own schema is stricter."""
    checked = 0
    for obj in render(load_values(setup)):
        if obj["kind"] in ("RayService", "RayJob"):
            for role, template in pod_templates(obj):
                name = f"{obj['metadata']['name']}-{role}"
                _validate_core(
                    {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
                )
                checked += 1
    assert checked >= 2


def test_strict_core_validation_catches_a_misspelt_field() -> None:
    """The check above is not vacuous: strict mode refuses a field the API does not have."""
    template = next(pod_templates(one(render({}), "RayService")))[1]
    broken = copy.deepcopy(template)
    broken["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolicyy"):
        _validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": broken})


@needs_crds
@pytest.mark.parametrize("setup", SETUPS)
def test_custom_resources_validate_against_their_crds(setup: str) -> None:
    schemas = crd_schemas(CRDS_DIR)
    for obj in render(load_values(setup)):
        if not _is_custom(obj):
            continue
        key = (obj["apiVersion"], obj["kind"])
        assert key in schemas, f"no CRD in {CRDS_DIR} serves {key}"
        errors = schema_errors(obj, schemas[key])
        assert not errors, f"{obj['kind']} {obj['metadata']['name']}:\n" + "\n".join(errors)


@needs_crds
def test_crd_validation_catches_unknown_fields_and_bad_values() -> None:
    """Strictness check: what the API server would drop or refuse is an error here too."""
    schemas = crd_schemas(CRDS_DIR)
    service = one(render({}), "RayService")
    schema = schemas[("ray.io/v1", "RayService")]
    assert schema_errors(service, schema) == []

    typo = copy.deepcopy(service)
    typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in e for e in schema_errors(typo, schema))

    wrong_type = copy.deepcopy(service)
    wrong_type["spec"]["serveConfigV2"] = {"applications": []}
    assert any(e.startswith("spec/serveConfigV2") for e in schema_errors(wrong_type, schema))

    repeated_port = copy.deepcopy(service)
    ports = repeated_port["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]
    ports.append(dict(ports[0]))
    assert any("duplicate entry" in e for e in schema_errors(repeated_port, schema))
