"""Monitoring files generated from the runtime metrics registry (`cluster/metrics/registry.py`).

    dashboard.py  the Grafana dashboard's rows, panels and PromQL, written against the registry
    grafana.py    renders them into dashboard JSON (grafana-foundation-sdk, the `test` extra)
    alerts.py     the Prometheus alert rules
    generate.py   writes or checks k8s/raytp/files/raytp-dashboard.json and raytp-alerts.yaml

Kept out of the installed packages (pyproject.toml's packages.find includes no `tools`): nothing at run
time needs them, and the Grafana SDK is a generation-time dependency.
"""
