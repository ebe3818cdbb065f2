#!/usr/bin/env bash
# Prepares a Debian bookworm machine with no image registry for `docker compose` (idempotent; run as root):
#   1. the Docker engine (Debian's docker.io) and the compose v2 CLI plugin (from Debian trixie's
#      docker-compose package, fetched through a private apt directory: bookworm does not package it);
#   2. dockerd, started without a bridge or iptables rules (containers talk over compose networks);
#   3. local base images built from Debian packages with debootstrap, since no registry is reachable:
#      dlc-base/python (python3 + venv; images add what they need with apt) and dlc-base/redis.
# Users with a registry skip this script: the Dockerfiles default to the official base images.
#
#   docker/engine.sh            all three steps
#   docker/engine.sh engine     steps 1 and 2 only
# Environment: DLC_DEBIAN_MIRROR (default: the first mirror in this machine's apt sources),
#              DLC_BASE_TAG (default bookworm), DOCKER_DATA (default /var/lib/docker).
set -euo pipefail

step() { printf '[engine.sh %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
need_root() { [ "$(id -u)" = 0 ] || { echo "docker/engine.sh must run as root (it installs packages and starts dockerd)" >&2; exit 2; }; }

mirror() {
  if [ -n "${DLC_DEBIAN_MIRROR:-}" ]; then echo "$DLC_DEBIAN_MIRROR"; return; fi
  local m
  m=$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
      | grep -o 'https\?://[^ ]*debian[^ ]*' | grep -v security | head -n1 || true)
  echo "${m:-http://deb.debian.org/debian}"
}

install_engine() {
  if ! command -v dockerd >/dev/null; then
    step "installing docker.io (engine, containerd, runc)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null; }
  fi
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
  local plugin=/usr/local/lib/docker/cli-plugins/docker-compose
  if ! "$plugin" version >/dev/null 2>&1; then
    step "fetching the compose v2 plugin from Debian trixie's docker-compose package"
    local d; d=$(mktemp -d)
    mkdir -p "$d/lists/partial" "$d/cache/archives/partial"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $(mirror) trixie main" > "$d/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$d/sources.list" -o Dir::Etc::SourceParts=/dev/null
                -o "Dir::State::Lists=$d/lists" -o "Dir::Cache=$d/cache" -o APT::Get::List-Cleanup=0)
    apt-get "${opts[@]}" update -q >/dev/null
    (cd "$d" && apt-get "${opts[@]}" download docker-compose >/dev/null)
    dpkg-deb -x "$d"/docker-compose_*.deb "$d/root"
    install -D -m 0755 "$d/root/usr/libexec/docker/cli-plugins/docker-compose" "$plugin"
    rm -rf "$d"
  fi
  step "$(docker compose version)"
}

start_engine() {
  if docker info >/dev/null 2>&1; then step "dockerd already answers"; return; fi
  step "starting dockerd (no default bridge, no iptables rules)"
  # A dockerd that ran with iptables may have left the FORWARD policy at DROP (it breaks container traffic).
  command -v iptables >/dev/null && iptables -P FORWARD ACCEPT 2>/dev/null || true
  mkdir -p /var/log
  nohup dockerd --bridge=none --iptables=false --data-root "${DOCKER_DATA:-/var/lib/docker}" \
    >/var/log/dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -n 30 /var/log/dockerd.log >&2; echo "dockerd did not start" >&2; exit 1; }
  step "dockerd $(docker version --format '{{.Server.Version}}') answers"
}

# One minbase rootfs per base image, imported as an image; skipped when the image exists.
build_base() {
  local name=$1; shift
  local tag="dlc-base/$name:${DLC_BASE_TAG:-bookworm}"
  if docker image inspect "$tag" >/dev/null 2>&1; then step "$tag exists"; return; fi
  step "debootstrap $tag ($*)"
  local root; root=$(mktemp -d /var/tmp/dlc-rootfs.XXXX)
  debootstrap --variant=minbase --include="$(IFS=,; echo "$*")" bookworm "$root" "$(mirror)" >/dev/null
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' - "$tag" >/dev/null
  rm -rf "$root"
  step "$tag: $(docker image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
}

need_root
install_engine
start_engine
if [ "${1:-all}" = all ]; then
  build_base python python3 python3-venv ca-certificates
  build_base redis redis-server
fi
