#!/bin/sh
# Writes the seven secrets of a Docker Swarm deployment (docker-stack.yml) into a folder, one random 48-hex-digit
# value per file, mode 600 in a folder of mode 700: `docker/make-secrets.sh secrets`, then
# `DLC_SECRETS=secrets docker stack deploy -c docker-stack.yml dlc` turns them into swarm secrets. A file that
# exists is kept (re-running never changes a deployed secret). Nothing is printed but the file names: read a
# value with `cat` where you need it (the dashboard's read-only token: dlc_dashboard_token). The coordinator's tokens,
# one per role (coordinator/auth.py): dlc_token (write: the operator, dlcctl), dlc_trainer_token, dlc_sampler_token,
# dlc_dashboard_token (read-only). To rotate one, delete its file and run this again (docker-stack.yml, README).
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
done
