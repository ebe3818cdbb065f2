#!/bin/sh
# Writes the seven secrets of a deployment (docker-compose.yml, docker-stack.yml) into a folder, one random
# 48-hex-digit value per file: `docker/make-secrets.sh secrets`, then `docker compose up` (compose reads ./secrets,
# or the folder DLC_SECRETS names) or `DLC_SECRETS=secrets docker stack deploy -c docker-stack.yml dlc` (swarm
# secrets). Each service gets only the files it needs, under /run/secrets, never as environment variables.
#
# The folder is mode 700: only its owner (and root) can reach the files. The files are mode 444, because compose
# bind-mounts a file secret as it is (its owner and mode; compose ignores `uid` and `mode`, which only Swarm
# honours) and the containers' user (uid 1000) must read it. A file that exists is kept (re-running never changes
# a deployed secret; it only sets the modes). Nothing is printed but the file names: read a value with `cat` where
# you need it (the dashboard's read-only token: dlc_dashboard_token). The coordinator's tokens, one per role
# (coordinator/auth.py): dlc_token (write: the operator, dlcctl), dlc_trainer_token, dlc_sampler_token,
# dlc_dashboard_token (read-only). To rotate one, delete its file and run this again (README, docs/compose.md).
# TLS certificates for several nodes: docker/make-certs.sh.
set -eu
dir="${1:?usage: docker/make-secrets.sh FOLDER}"
umask 077
mkdir -p "$dir"
chmod 700 "$dir"
for name in dlc_token dlc_dashboard_token dlc_trainer_token dlc_sampler_token redis_coordinator_password \
            redis_trainer_password redis_sampler_password; do
    if [ -s "$dir/$name" ]; then
        echo "kept    $dir/$name"
    else
        od -An -N24 -tx1 /dev/urandom | tr -d ' \n' > "$dir/$name.tmp"
        mv "$dir/$name.tmp" "$dir/$name"
        echo "written $dir/$name"
    fi
    chmod 444 "$dir/$name"
done
