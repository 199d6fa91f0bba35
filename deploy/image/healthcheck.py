"""The image's HEALTHCHECK: GET /healthz on the daemon's metrics port; exit 0 only on 200.

The address comes from the config the daemon runs with ($ECD_CONFIG, [metrics] listen), so a
config mounted over /etc/ecd/node.toml with another port is still checked; a wildcard listen
address is reached through loopback. Standard library only: it runs every few seconds.
"""
import os
import sys
import tomllib
import urllib.error
import urllib.request

config = os.environ.get("ECD_CONFIG", "/etc/ecd/node.toml")
try:
    with open(config, "rb") as f:
        listen = tomllib.load(f).get("metrics", {}).get("listen", "127.0.0.1:9464")
except (OSError, tomllib.TOMLDecodeError) as e:
    sys.exit(f"unhealthy: cannot read {config}: {e}")
if not listen:
    sys.exit(f"unhealthy: {config} turns the metrics endpoint off ([metrics] listen = \"\"), "
             "so there is no /healthz to check")
host, _, port = listen.rpartition(":")
host = host.strip("[]")
if host in ("0.0.0.0", "", "::"):
    host = "127.0.0.1" if host != "::" else "::1"
url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/healthz"
try:
    with urllib.request.urlopen(url, timeout=2.5) as reply:
        print(reply.read().decode(errors="replace").strip())
except urllib.error.HTTPError as e:  # 503: starting or draining
    sys.exit(f"unhealthy: {url} answered {e.code}: {e.read().decode(errors='replace').strip()}")
except OSError as e:
    sys.exit(f"unhealthy: {url}: {e}")
