#!/bin/sh
# The redis service's entrypoint (docker-compose.yml, docker-stack.yml): installs Redis's ACL users for the run,
# so no password is ever on redis-server's command line (which `ps` shows to every user of the host).
#
# The users and their rules come from the image's /etc/dlc/redis-users.acl (docker/redis-users.acl, generated
# from rlcommon/redis_acl.py; $DLC_REDIS_ACL_TEMPLATE overrides the path), for run $DLC_RUN_ID (default
# `default`). Each user's password is the file $DLC_REDIS_SECRETS/redis_<user>_password (default /run/secrets:
# Docker Swarm's secrets), else the variable DLC_REDIS_PASSWORD_<USER> (compose); a user whose rules turn it
# `on` must have one. The ACL file written ($DLC_REDIS_ACL_FILE, default /tmp/dlc-users.acl, mode 600) holds
# each password's sha256, not the password, and the password variables are unset before the command runs:
#   dlc-redis-acl redis-server --appendonly yes ...   runs   redis-server --appendonly yes ... --aclfile FILE
set -eu
template="${DLC_REDIS_ACL_TEMPLATE:-/etc/dlc/redis-users.acl}"
secrets="${DLC_REDIS_SECRETS:-/run/secrets}"
acl="${DLC_REDIS_ACL_FILE:-/tmp/dlc-users.acl}"
run_id="${DLC_RUN_ID:-default}"
fail() { echo "dlc-redis-acl: $*" >&2; exit 2; }
printf %s "$run_id" | grep -Eq '^[A-Za-z0-9_.-]{1,64}$' || fail "DLC_RUN_ID '$run_id': 1-64 of letters, digits, _ . -"
[ -r "$template" ] || fail "cannot read the users' rules $template"
umask 077
: > "$acl"
count=0
while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in ''|'#'*) continue ;; "user "*) ;; *) fail "$template: not a user line: $line" ;; esac
    rest=${line#user }
    user=${rest%% *}
    rules=$(printf %s "${rest#* }" | sed "s/__RUN_ID__/$run_id/g")
    secret="$secrets/redis_${user}_password"
    if [ -r "$secret" ]; then
        password=$(cat "$secret")
        [ -n "$password" ] || fail "$secret is empty"
    else
        upper=$(printf %s "$user" | tr 'a-z' 'A-Z')
        eval "password=\${DLC_REDIS_PASSWORD_$upper:-}"
    fi
    if [ -n "$password" ]; then
        rules="$rules #$(printf %s "$password" | sha256sum | cut -d' ' -f1)"
    elif [ "${rules%% *}" = "on" ]; then
        fail "user $user is on but has no password: neither $secret nor DLC_REDIS_PASSWORD_$(printf %s "$user" | tr 'a-z' 'A-Z')"
    fi
    printf 'user %s %s\n' "$user" "$rules" >> "$acl"
    count=$((count + 1))
done < "$template"
[ "$count" -gt 0 ] || fail "$template defines no user"
for name in $(env | sed -n 's/^\(DLC_REDIS_PASSWORD_[A-Za-z0-9_]*\)=.*/\1/p'); do unset "$name"; done
echo "dlc-redis-acl: $count users of run $run_id written to $acl"
exec "$@" --aclfile "$acl"
