"""The built image's configuration, and docker/compose.yaml against it, for scripts/docker_check.sh.

    python scripts/docker_image_check.py inspect INSPECT_JSON --env-out FILE
    python scripts/docker_image_check.py compose INSPECT_JSON --env-out FILE --set NAME=VALUE ... \
        --redis-address HOST:PORT --port PORT

`inspect` (the output of `podman image inspect`): prints the image's size and whether its config keeps the
HEALTHCHECK, writes its environment (`NAME=VALUE` lines) and its health command (one JSON line), and fails
without a health check. `compose`: checks the promptcache service against the image — every PROMPTCACHE_*
variable is a server setting, the API keys file is the mounted secret, the volume is the image's VOLUME, the
container port is the image's, the health check runs what the image's does — then writes the environment
the service would run with: the image's, then compose's (`${NAME:?...}` filled from --set, the Redis URL
pointed at --redis-address and the port at --port).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from promptcache.server.settings import ServerSettings

COMPOSE = Path(__file__).resolve().parents[1] / "docker" / "compose.yaml"
VARIABLE = re.compile(r"\$\{(\w+)(?::?[?-][^}]*)?\}")


def image_config(inspect_file: Path) -> dict:
    image = json.loads(inspect_file.read_text())[0]
    config = image.get("Config") or {}
    health = image.get("Healthcheck") or image.get("HealthCheck") or config.get("Healthcheck") or {}
    return {"size_mb": round(image["Size"] / 2**20), "env": config.get("Env") or [], "health": health.get("Test"),
            "volumes": sorted(config.get("Volumes") or {}), "ports": sorted(config.get("ExposedPorts") or {}),
            "user": config.get("User"), "entrypoint": config.get("Entrypoint")}


def inspect(args: argparse.Namespace) -> int:
    config = image_config(args.inspect)
    args.env_out.write_text("".join(f"{line}\n" for line in config["env"]))
    args.health_out.write_text(json.dumps(config["health"]) + "\n")
    print(json.dumps({"check": "image", "size_mb": config["size_mb"], "healthcheck": config["health"] is not None,
                      "user": config["user"], "entrypoint": config["entrypoint"], "volumes": config["volumes"],
                      "ports": config["ports"]}))
    return 0 if config["health"] else 1


def compose(args: argparse.Namespace) -> int:
    config = image_config(args.inspect)
    spec = yaml.safe_load(COMPOSE.read_text())
    service = spec["services"]["promptcache"]
    values = dict(item.split("=", 1) for item in args.set)
    env = {name: VARIABLE.sub(lambda m: values[m.group(1)], str(value))
           for name, value in service["environment"].items()}
    problems = []
    settings = {f"PROMPTCACHE_{name.upper()}" for name in ServerSettings.model_fields}
    problems += [f"{name} is not a server setting" for name in env if name not in settings]
    secrets = {f"/run/secrets/{name}" for name in service.get("secrets", [])}
    if env.get("PROMPTCACHE_API_KEYS_FILE") not in secrets:
        problems.append(f"PROMPTCACHE_API_KEYS_FILE is not one of the mounted secrets {sorted(secrets)}")
    targets = {volume.split(":")[1] for volume in service["volumes"]}
    if targets != set(config["volumes"]):
        problems.append(f"compose mounts {sorted(targets)}, the image's volumes are {config['volumes']}")
    container_ports = {f"{port.split(':')[-1]}/tcp" for port in service["ports"]}
    if container_ports != set(config["ports"]):
        problems.append(f"compose publishes {sorted(container_ports)}, the image exposes {config['ports']}")
    if service["healthcheck"]["test"][1:] != (config["health"] or [])[1:]:
        problems.append(f"compose's health check {service['healthcheck']['test']} "
                        f"is not the image's {config['health']}")
    if problems:
        print(json.dumps({"check": "compose", "problems": problems}))
        return 1
    variables = sorted(env)
    env["PROMPTCACHE_REDIS_URL"] = re.sub(r"@redis:6379/", f"@{args.redis_address}/", env["PROMPTCACHE_REDIS_URL"])
    env["PROMPTCACHE_PORT"] = str(args.port)
    merged = dict(line.split("=", 1) for line in config["env"]) | env
    args.env_out.write_text("".join(f"{name}={value}\n" for name, value in merged.items()))
    print(json.dumps({"check": "compose", "variables": variables, "secrets": sorted(secrets),
                      "volumes": sorted(targets)}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("inspect", "compose"):
        command = commands.add_parser(name)
        command.add_argument("inspect", type=Path, help="`podman image inspect` output")
        command.add_argument("--env-out", type=Path, required=True)
    commands.choices["inspect"].add_argument("--health-out", type=Path, required=True)
    commands.choices["compose"].add_argument("--set", action="append", default=[], help="NAME=VALUE")
    commands.choices["compose"].add_argument("--redis-address", required=True, help="HOST:PORT of the Redis to use")
    commands.choices["compose"].add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    return inspect(args) if args.command == "inspect" else compose(args)


if __name__ == "__main__":
    sys.exit(main())
