"""Router replicas placed by Ray resource: deploy/node_resources.py gives each host listed
under `router:` in deploy/nodes.yaml the resource `router` that `router.resources` asks for
(the shipped file lists none: every replica on the head), and the serve config takes
`router.resources` and `router.host: null` (each replica on its node's address)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from pdserve.cluster.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def resources_of_this_host(nodes_yaml: Path) -> dict:
    """What `ray start --resources` gets here from `nodes_yaml` (as deploy/cluster.yaml runs it)."""
    out = subprocess.run([sys.executable, str(DEPLOY / "node_resources.py"), str(nodes_yaml)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_a_host_listed_under_router_offers_the_router_resource(tmp_path):
    nodes = yaml.safe_load((DEPLOY / "nodes.yaml").read_text())
    assert not nodes["router"] and "router" not in resources_of_this_host(DEPLOY / "nodes.yaml")
    nodes["router"] = {"127.0.0.1": 1, "192.0.2.1": 1}  # this host and another
    (tmp_path / "nodes.yaml").write_text(yaml.safe_dump(nodes))
    assert resources_of_this_host(tmp_path / "nodes.yaml")["router"] == 1


def test_the_serve_config_places_router_replicas_by_resource_on_their_nodes_address():
    config = load_config(DEPLOY / "cluster-serve.yaml", {"router.host": None, "router.resources": {"router": 1}})
    assert config.router.resources == {"router": 1} and config.router.host is None
    assert load_config(None).router.resources == {}  # default: on the head, as before
