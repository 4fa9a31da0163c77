"""Print this host's Ray custom resources (JSON) from deploy/nodes.yaml, for `ray start
--resources`. A host is matched by any of its addresses (127.0.0.1 included)."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import yaml


def local_addresses() -> set[str]:
    addresses = {"127.0.0.1", "localhost", socket.gethostname()}
    try:
        addresses.update(subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split())
    except OSError:
        pass
    try:
        addresses.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    except OSError:
        pass
    return addresses


def main() -> None:
    nodes_file = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("nodes.yaml")
    pools = yaml.safe_load(nodes_file.read_text()) or {}
    mine = local_addresses()
    resources = {}
    for pool, hosts in pools.items():
        for host, slots in (hosts or {}).items():
            if str(host) in mine:
                resources[pool] = resources.get(pool, 0) + int(slots)
    print(json.dumps(resources))


if __name__ == "__main__":
    main()
