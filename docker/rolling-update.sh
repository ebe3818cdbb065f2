#!/usr/bin/env bash
# A rolling update of a compose project's sampler replicas (compose has none of its own; `up --force-recreate`
# replaces every replica at once and the trainer waits for their engines to start). One replica at a time: a new one
# is started from the service's current image and configuration and waited for until the coordinator lists it
# healthy at the published weight version; then an old one is stopped (SIGTERM: it drains within sampler.drain_s,
# leaves the fleet and hands back what it did not finish) and removed. Never fewer replicas serve than before.
#
#   docker/rolling-update.sh -p dlc -f docker-compose.yml     # the options `docker compose` takes
#   DLC_ROLL_TIMEOUT_S=900                                    # how long a new replica may take to serve
#
# On GPUs each new replica needs a free GPU while the old one still holds its own: on a node whose GPUs are all
# taken, stop one first (`docker stop` of an old replica), then run this for the rest.
set -euo pipefail

compose=(docker compose "$@")
timeout_s=${DLC_ROLL_TIMEOUT_S:-900}
say() { echo "[rolling-update $(date +%T)] $*"; }

mapfile -t old < <("${compose[@]}" ps -q sampler)
n=${#old[@]}
if [ "$n" -eq 0 ]; then
    echo "rolling-update: no running sampler replica in this project" >&2
    exit 2
fi

# 0 when the coordinator lists sampler $1 healthy at the published version or the one before (dlcctl in the
# coordinator's container: its address and token are there).
serving() {
    "${compose[@]}" exec -T coordinator python - "$1" <<'EOF'
import json, subprocess, sys
out = subprocess.run([sys.executable, "-m", "coordinator.dlcctl", "status", "--json"], capture_output=True, text=True)
status = json.loads(out.stdout) if out.returncode == 0 else {"samplers": []}
me = [s for s in status["samplers"] if s["sampler_id"] == sys.argv[1]]
# at the published version or the one before: a sync may be in flight (at full speed they can come every second)
ok = me and me[0]["health"] == "SAMPLER_HEALTHY" and me[0]["weight_version"] >= status.get("published_version", 0) - 1
sys.exit(0 if ok else 1)
EOF
}

say "replacing $n sampler replica(s), one at a time"
for container in "${old[@]}"; do
    mapfile -t before < <("${compose[@]}" ps -q sampler)
    "${compose[@]}" up -d --no-deps --no-recreate --scale "sampler=$((n + 1))" sampler
    new=""
    for id in $("${compose[@]}" ps -q sampler); do
        [[ " ${before[*]} " == *" $id "* ]] || new=$id
    done
    if [ -z "$new" ]; then
        echo "rolling-update: compose started no new sampler replica" >&2
        exit 1
    fi
    sampler_id="${new:0:12}-1"  # its hostname (the container id) and the PID of its main process
    deadline=$((SECONDS + timeout_s))
    until serving "$sampler_id"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "rolling-update: $sampler_id did not serve within ${timeout_s} s; $container left running" >&2
            exit 1
        fi
        sleep 2
    done
    say "${new:0:12} serves the current version; stopping ${container:0:12} (it drains and leaves)"
    docker stop --time 30 "$container" >/dev/null
    docker rm "$container" >/dev/null
done
say "done: $n replica(s) replaced"
